"""`serve run deployments/app.yaml` against `vllm serve` on one machine, one server at a time, the
same load client (bench_serve.py) and requests: output tokens/s, TTFT and ITL percentiles, and
each server's ratios against the first one.

    python benchmarks/serve_side_by_side.py --model /tmp/ponytail-smollm2-random \\
        --servers ponytail,ponytail:engine_process=false,vllm --vllm-pythonpath "$VLLM_SITE" --json side.json

A server is `ponytail` (deployments/app.yaml as shipped, with `model:` set to --model), optionally
with `:arg=value;arg=value` overriding app args (`ponytail:engine_process=false`), or `vllm` (vLLM's
OpenAI server with its defaults, `python -m vllm.entrypoints.openai.api_server --model MODEL`,
under --vllm-python with --vllm-pythonpath; one GPU each, so never at the same time). Each is
started, waited for (GET /v1/models), loaded at every --concurrency, and stopped (its process
group, then `ray stop` for Ponytail) before the next starts. A server that does not come up in
--start-timeout is reported as such, with the tail of its log, and the others still run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from bench_serve import parse_levels, print_report, requests_for, run_level
from serve_args import known, nested

ROOT = Path(__file__).resolve().parent.parent
PONYTAIL_PORT, VLLM_PORT = 8000, 8001


def ponytail_config(model: str, overrides: dict[str, str]) -> dict:
    """deployments/app.yaml with the model and the given app args replaced (the args' types are
    AppArgs' to check: a typo fails the app's start, named)."""
    from deployments.app.args import AppArgs

    config = yaml.safe_load((ROOT / "deployments" / "app.yaml").read_text())
    args = config["applications"][0]["args"]
    unknown = [name for name in overrides if not known(name, AppArgs.model_fields)]
    if unknown:
        raise SystemExit(f"--servers: unknown app args {unknown}; allowed: the app's args and LLM's arguments "
                         "(docs/configuration.md)")
    given = nested({name: yaml.safe_load(value) for name, value in overrides.items()})
    args.update({"model": model, **given, "engine": {**args.get("engine", {}), **given.get("engine", {})}})
    return config


def parse_server(spec: str) -> tuple[str, dict[str, str]]:
    """'ponytail:engine_process=false;compile_model=true' -> ('ponytail', {...}); 'vllm' -> ('vllm', {})."""
    kind, _, rest = spec.partition(":")
    if kind not in ("ponytail", "vllm"):
        raise argparse.ArgumentTypeError(f"--servers {spec!r}: expected ponytail[:arg=value;...] or vllm")
    overrides = {}
    for item in filter(None, rest.split(";")):
        name, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--servers {spec!r}: expected arg=value after ponytail:")
        overrides[name.strip()] = value.strip()
    if kind == "vllm" and overrides:
        raise argparse.ArgumentTypeError(f"--servers {spec!r}: vllm runs with its defaults")
    return kind, overrides


def start_server(kind: str, overrides: dict, args, workdir: Path, log) -> tuple[subprocess.Popen, str]:
    if kind == "ponytail":
        app = workdir / "app.yaml"
        app.write_text(yaml.safe_dump(ponytail_config(args.model, overrides)))
        command = [sys.executable, "-m", "ray.serve.scripts", "run", str(app)]
        env, port = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}, PONYTAIL_PORT
    else:
        command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
                   "--port", str(VLLM_PORT)]
        env = {**os.environ, "PYTHONPATH": args.vllm_pythonpath or ""}
        port = VLLM_PORT
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                               start_new_session=True)
    return process, f"http://127.0.0.1:{port}/v1"


def wait_until_up(url: str, process: subprocess.Popen, timeout: float) -> float | None:
    """Seconds until GET /v1/models answered with a model; None if it did not in `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=5) as response:
                if json.loads(response.read()).get("data"):
                    return time.monotonic() - start
        except (OSError, ValueError):
            pass
        time.sleep(2)
    return None


def stop_server(kind: str, process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: serve run deletes the app, vLLM shuts down
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    if kind == "ponytail":
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint directory both servers load")
    parser.add_argument("--servers", default="ponytail,vllm",
                        help="in order, comma-separated: ponytail[:arg=value;arg=value] or vllm")
    parser.add_argument("--vllm-python", default=sys.executable)
    parser.add_argument("--vllm-pythonpath", help="PYTHONPATH for vLLM's process (its own site, not Ponytail's pins)")
    parser.add_argument("--concurrency", type=parse_levels, default=[64, 256])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=7680)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--logs", default=None, help="folder for the servers' logs (default: a temporary one)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    servers = [parse_server(spec) for spec in args.servers.split(",")]
    for kind, overrides in servers:
        if kind == "ponytail":
            ponytail_config(args.model, overrides)  # unknown args refused before anything starts
    work = requests_for(args.requests, 0, args.max_len, 1)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="side-by-side-"))
    logs.mkdir(parents=True, exist_ok=True)
    runs, names, started = [], [], {}
    for index, (kind, overrides) in enumerate(servers):
        name = kind + "".join(f" {k}={v}" for k, v in overrides.items())
        side = chr(ord("A") + index)
        names.append(f"{side}: {name}")
        with tempfile.TemporaryDirectory() as workdir, (logs / f"server_{side}.log").open("w") as log:
            process, url = start_server(kind, overrides, args, Path(workdir), log)
            try:
                up = wait_until_up(url, process, args.start_timeout)
                started[side] = up
                if up is None:
                    tail = (logs / f"server_{side}.log").read_text(errors="replace")[-3000:]
                    print(f"{side} ({name}) did not come up in {args.start_timeout:.0f} s; its log ends:\n{tail}")
                    continue
                print(f"{side} ({name}) up after {up:.0f} s", flush=True)
                for level in args.concurrency:
                    runs.append({"server": side, "name": name,
                                 **asyncio.run(run_level(url, None, work, level, 900.0))})
            finally:
                stop_server(kind, process)
    if runs:
        print_report(runs, [])  # its footer names two servers at most: ours follows
        print("\n".join(names))
        first = runs[0]["server"]
        for run in runs:
            base = next((r for r in runs if r["server"] == first and r["concurrency"] == run["concurrency"]), None)
            if base is not None and run["server"] != first and base["output_tokens_per_s"]:
                ttft = (f"{run['ttft_p99'] / base['ttft_p99']:.2f}x" if run["ttft_p99"] and base["ttft_p99"] else "-")
                print(f"{run['server']} against {first} at concurrency {run['concurrency']}: output tokens/s "
                      f"{run['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x, p99 TTFT {ttft}")
    if args.json:
        Path(args.json).write_text(json.dumps({"servers": names, "start_seconds": started, "runs": runs}, indent=2))
    return 0 if runs and all(not r["errors"] for r in runs) and all(v is not None for v in started.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
