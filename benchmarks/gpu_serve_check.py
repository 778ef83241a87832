"""`serve run deployments/app.yaml` on the two-GPU machine: two replicas, one GPU each, the OpenAI client.

    # here, once: the default model's config and tokenizer files (no weights) into the git-ignored .gpu/
    python benchmarks/random_checkpoint.py export .gpu/smollm2-files
    # on the GPU machine, from the repository root (~2-4 min):
    python benchmarks/gpu_serve_check.py --files .gpu/smollm2-files --json $OUT/gpu_serve_check.json
    # anywhere, to try the script itself: CPU replicas, no GPU check
    python benchmarks/gpu_serve_check.py --files .gpu/smollm2-files --device cpu

1. Builds a random-weight bf16 checkpoint shaped like SmolLM2-135M-Instruct with its real tokenizer
   and chat template (random_checkpoint.py; the GGUF default model cannot be carried there).
2. Writes a copy of deployments/app.yaml with `model:` set to it and min_replicas = max_replicas
   = 2, everything else as in the file, and starts it with Serve's own CLI (`serve run`, which
   starts a local Ray cluster and sees both GPUs; `device: auto` then gives each replica one).
3. Waits for /health and for two running engine replicas, then calls /v1/models, a chat
   completion, a completion and a streaming completion with the official `openai` client, and a
   burst of chat requests that reaches both replicas.
4. Asks each replica for its device and GPU UUID (ray.init(address="auto"), EngineReplica.report)
   and checks that they are CUDA devices with different UUIDs (skipped with --device cpu).

Prints every result and writes them as JSON with --json (the `serve run` log goes next to it).
Exits nonzero on any failed check; `serve run` is stopped with Ctrl-C (SIGINT) as a user would,
which shuts Serve and its Ray cluster down, and killed if it does not exit.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

import openai  # here, not after minutes of startup: the GPU machine's bundle must carry it
import yaml
from transformers import AutoTokenizer

from random_checkpoint import build_checkpoint

ROOT = Path(__file__).resolve().parent.parent
APP_NAME = "ponytail"


class CheckFailed(Exception):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def write_app_yaml(path: Path, model: Path, device: str, kv_cache_memory: str | None) -> dict:
    """deployments/app.yaml with this model and exactly two engine replicas; returns the config."""
    config = yaml.safe_load((ROOT / "deployments" / "app.yaml").read_text())
    (app,) = [a for a in config["applications"] if a["name"] == APP_NAME]
    app["args"].update(model=str(model), min_replicas=2, max_replicas=2)
    if device != "auto":
        app["args"]["device"] = device
    if kv_cache_memory is not None:
        app["args"]["kv_cache_memory"] = kv_cache_memory
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return config


def start_serve_run(app_yaml: Path, log: Path, device: str) -> subprocess.Popen:
    """`serve run app.yaml` (the CLI's own entry point: the bundle may install no `serve` script)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    if device == "cpu" and "RAY_OVERRIDE_RESOURCES" not in env:
        # Two engine replicas and the ingress take a logical CPU each; a 2-core laptop has too few.
        env["RAY_OVERRIDE_RESOURCES"] = json.dumps({"CPU": max(8, os.cpu_count() or 1)})
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "ray.serve.scripts", "run", str(app_yaml)], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_serve_run(process: subprocess.Popen, timeout: float = 90) -> int | None:
    """Ctrl-C, as a user stops `serve run`; then SIGTERM and SIGKILL to its process group."""
    for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        if process.poll() is not None:
            break
        try:
            if sig == signal.SIGINT:
                process.send_signal(sig)
            else:
                os.killpg(process.pid, sig)  # its own session: Ray's processes it started, nothing else
        except ProcessLookupError:
            break
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            print(f"`serve run` still running {wait:.0f} s after {sig.name}")
    return process.poll()


def wait_for_health(port: int, process: subprocess.Popen, deadline: float) -> float:
    started = time.monotonic()
    while time.monotonic() < deadline:
        check(process.poll() is None, f"`serve run` exited with {process.returncode} before /health answered")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        time.sleep(1)
    raise CheckFailed("/health did not answer 200 in time")


def wait_for_replicas(process: subprocess.Popen, deadline: float) -> dict:
    import ray
    from ray import serve

    while not ray.is_initialized():
        try:
            ray.init(address="auto", log_to_driver=False)
        except ConnectionError:
            check(time.monotonic() < deadline, "no Ray cluster to connect to (address='auto')")
            time.sleep(1)
    while time.monotonic() < deadline:
        check(process.poll() is None, f"`serve run` exited with {process.returncode}")
        app = serve.status().applications.get(APP_NAME)
        if app is not None:
            check(app.status != "DEPLOY_FAILED", f"the app failed to deploy: {app.message}")
            engines = app.deployments.get("EngineReplica")
            if app.status == "RUNNING" and engines and engines.replica_states.get("RUNNING", 0) == 2:
                states = {str(k): v for k, v in engines.replica_states.items()}
                return {"app": str(app.status), "engine_replicas": states}
        time.sleep(1)
    raise CheckFailed("the app did not reach RUNNING with two engine replicas in time")


def openai_checks(port: int, model_dir: Path) -> dict:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
    results = {}
    models = [m.id for m in client.models.list().data]
    results["models"] = models
    check(len(models) == 1, f"/v1/models lists {models}, expected one model")
    model = models[0]
    ignore_eos = {"ignore_eos": True}  # random weights: EOS can come at any time

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                          extra_body=ignore_eos)
    template = AutoTokenizer.from_pretrained(model_dir, local_files_only=True).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    results["chat"] = {"text": chat.choices[0].message.content, "finish_reason": chat.choices[0].finish_reason,
                       "usage": chat.usage.model_dump(), "chat_template_tokens": len(template)}
    check(chat.usage.completion_tokens == 16 and chat.choices[0].finish_reason == "length", f"chat: {results['chat']}")
    check(chat.usage.prompt_tokens == len(template),
          f"chat prompt has {chat.usage.prompt_tokens} tokens, SmolLM2's chat template gives {len(template)}")

    prompt = "The capital of France is"
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                           extra_body=ignore_eos)
    chunks, usage, finish = [], None, None
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body=ignore_eos):
        if chunk.choices:
            chunks.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    streamed = "".join(chunks)
    results["completion"] = {"text": completion.choices[0].text, "usage": completion.usage.model_dump()}
    results["stream"] = {"chunks": len(chunks), "text": streamed, "finish_reason": finish, "usage": usage,
                         "same_text_as_non_streaming": streamed == completion.choices[0].text}
    check(completion.usage.completion_tokens == 16, f"completion: {results['completion']}")
    check(usage is not None and usage["completion_tokens"] == 16 and finish == "length",
          f"stream: {results['stream']}")

    def one(index):
        reply = client.chat.completions.create(model=model, max_tokens=64, temperature=0.8, extra_body=ignore_eos,
                                               messages=[{"role": "user", "content": f"Tell story number {index}."}])
        return reply.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        burst = list(pool.map(one, range(32)))
    results["burst"] = {"requests": len(burst), "completion_tokens": sum(burst)}
    check(burst == [64] * 32, f"burst of 32 chat requests: completion tokens {burst}")
    return results


def replica_checks(device: str) -> dict:
    from deployments.app.reports import replica_reports

    reports = replica_reports(APP_NAME, replicas=2)
    replicas = {name: {"device": r.info.device, "device_uuid": r.info.device_uuid, "model_id": r.info.model_id,
                       "max_model_len": r.info.max_model_len, "requests_taken": r.num_requests,
                       "kv_total_blocks": r.routing["total_blocks"], "kv_free_blocks": r.routing["free_blocks"],
                       "preemptions": r.stats.num_preemptions}
                for name, r in reports.items()}
    check(all(r["requests_taken"] > 0 for r in replicas.values()), f"a replica served nothing: {replicas}")
    uuids = [r["device_uuid"] for r in replicas.values()]
    if device == "cpu":
        print("NOTE: --device cpu: the replicas own no GPU, so the device UUID check is skipped")
        return {"replicas": replicas, "uuid_check": "skipped (--device cpu)"}
    check(all(r["device"].startswith("cuda") for r in replicas.values()), f"a replica is not on a GPU: {replicas}")
    check(None not in uuids and len(set(uuids)) == 2, f"the replicas do not own different GPUs: {uuids}")
    return {"replicas": replicas, "uuid_check": "passed: two different GPUs"}


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", default=".gpu/smollm2-files", help="config + tokenizer files (no weights)")
    parser.add_argument("--checkpoint", default="/tmp/ponytail-smollm2-random", help="where the weights go")
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto",
                        help="auto: app.yaml as it is (one GPU per replica); cpu: a dry run without GPUs")
    parser.add_argument("--kv-cache-memory", help="override app.yaml's kv_cache_memory (null there)")
    parser.add_argument("--startup-timeout", type=float, default=360)
    parser.add_argument("--json")
    args = parser.parse_args()

    started = time.monotonic()
    results: dict = {"ok": False, "device": args.device}
    workdir = Path(tempfile.mkdtemp(prefix="gpu-serve-check-"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    log = Path(args.json).with_suffix(".serve.log") if args.json else workdir / "serve.log"
    process = None
    try:
        checkpoint = build_checkpoint(args.files, args.checkpoint)
        results["checkpoint"] = str(checkpoint)
        results["build_s"] = round(time.monotonic() - started, 1)
        print(f"random-weight checkpoint: {checkpoint} ({results['build_s']} s)")
        config = write_app_yaml(workdir / "app.yaml", checkpoint, args.device, args.kv_cache_memory)
        results["app_yaml"] = config
        port = config.get("http_options", {}).get("port", 8000)
        check(port_is_free(port), f"port {port} (app.yaml's http_options) is taken: another Serve running?")
        print(yaml.safe_dump(config, sort_keys=False))
        process = start_serve_run(workdir / "app.yaml", log, args.device)
        deadline = time.monotonic() + args.startup_timeout
        results["health_s"] = round(wait_for_health(port, process, deadline), 1)
        results["status"] = wait_for_replicas(process, deadline)
        results["ready_s"] = round(time.monotonic() - started, 1)
        print(f"ready after {results['ready_s']} s: {results['status']}")
        results["openai"] = openai_checks(port, checkpoint)
        print(json.dumps(results["openai"], indent=2))
        results.update(replica_checks(args.device))
        print(json.dumps(results["replicas"], indent=2))
        print(f"device UUIDs: {results['uuid_check']}")
        results["ok"] = True
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()  # only this driver's connection; `serve run` owns the cluster
        if process is not None:
            results["serve_run_exit"] = stop_serve_run(process)
            if not results["ok"] and log.exists():
                print(f"--- last lines of the `serve run` log ({log}):")
                print("\n".join(log.read_text(errors="replace").splitlines()[-60:]))
        results["total_s"] = round(time.monotonic() - started, 1)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    print(f"{'PASSED' if results['ok'] else 'FAILED'} in {results['total_s']} s"
          + ("" if results["ok"] else f": {results['error']}"))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
