"""`ponytail bench`: its flags, a rich progress bar, and the files and tables it leaves.

Exit status: 0 done, 1 the output check failed (no speed is quoted), 130 stopped by Ctrl-C
(what had run is still written), 2 bad input (cli.main)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..utils.dtypes import KV_CACHE_DTYPES
from .run import BASELINES, BenchConfig, Progress, run_bench
from .workload import WORKLOADS

DEFAULTS = BenchConfig.__dataclass_fields__


def add_parser(commands) -> None:
    """Register `bench` on the `ponytail` command's subparsers."""
    d = {name: f.default for name, f in DEFAULTS.items()}
    p = commands.add_parser(
        "bench", help="check outputs, then speed and memory, against plain transformers",
        description="On your model: greedy outputs against plain model.generate (judged by the model in "
                    "float32), then output tokens/s, TTFT and TPOT for both, then device memory over time "
                    "with Ponytail's KV pool (PNG + CSV in --out).")
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="checkpoint directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--requests", type=int, default=d["requests"], help=f"requests (default: {d['requests']})")
    p.add_argument("--prompt-len", type=int, default=d["prompt_len"],
                   help=f"prompt tokens, random ids (default: {d['prompt_len']})")
    p.add_argument("--output-len", type=int, default=d["output_len"],
                   help=f"tokens generated per request, EOS ignored (default: {d['output_len']})")
    p.add_argument("--workload", default=d["workload"], metavar="|".join(WORKLOADS),
                   help="uniform: every request the same lengths; mixed: lengths from 1/4 to the full "
                        "values; prefix: prompts share their first 3/4 (default: uniform)")
    p.add_argument("--kv-cache-memory", metavar="SIZE",
                   help='Ponytail\'s KV budget, e.g. "4GiB" (default: what vLLM\'s gpu_memory_utilization=0.9 '
                        'leaves for KV, 2 GiB on the CPU)')
    p.add_argument("--kv-cache-dtype", default=d["kv_cache_dtype"], metavar="|".join(KV_CACHE_DTYPES),
                   help="auto: K/V in the model's dtype; fp8 or fp8_e4m3: Ponytail runs twice, K/V in the model's "
                        "dtype and then in FP8, under the same --kv-cache-memory, both in the tables and the "
                        "memory timeline (default: auto)")
    p.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction, default=None,
                   help="FP8: take each layer's K/V scales from the first prompt when the checkpoint has none "
                        "(default: on with FP8, as the embedded model has no scales)")
    p.add_argument("--baseline", default=d["baseline"], metavar="|".join(BASELINES),
                   help="time plain model.generate too, or not (default: generate)")
    p.add_argument("--baseline-batch", type=int, metavar="N",
                   help="requests per plain generate call (default: all at once)")
    p.add_argument("--out", type=Path, default=d["out"], metavar="DIR",
                   help=f"where memory.png, memory.csv and summary.json go (default: {d['out']})")
    p.add_argument("--device", default=d["device"], help="auto, cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--dtype", help="bfloat16, float16 or float32 (default: float32 on the CPU, bfloat16 on CUDA)")
    p.add_argument("--check-requests", type=int, default=d["check_requests"],
                   help=f"requests in the output check (default: {d['check_requests']})")
    p.add_argument("--check-tokens", type=int, default=d["check_tokens"],
                   help=f"greedy tokens compared per request; 0 skips the check (default: {d['check_tokens']})")
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"],
                   help=f"Ponytail's most running requests (default: {d['max_num_seqs']})")
    p.add_argument("--kv-release-after", type=float, default=d["kv_release_after"], metavar="SECONDS",
                   help="spare KV memory goes back to the device after this long (default: 30)")
    p.add_argument("--idle", type=float, default=d["idle"], metavar="SECONDS",
                   help="keep watching Ponytail's pool this long after the last request (default: 0)")
    p.add_argument("--sample-interval", type=float, default=d["sample_interval"], metavar="SECONDS",
                   help=f"between memory samples (default: {d['sample_interval']})")
    p.add_argument("--seed", type=int, default=d["seed"], help="for the random prompts (default: 0)")
    p.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    config = BenchConfig(model=args.model, requests=args.requests, prompt_len=args.prompt_len,
                         output_len=args.output_len, workload=args.workload, kv_cache_memory=args.kv_cache_memory,
                         baseline=args.baseline, baseline_batch=args.baseline_batch, out=args.out,
                         device=args.device, dtype=args.dtype, check_requests=args.check_requests,
                         check_tokens=args.check_tokens, max_num_seqs=args.max_num_seqs,
                         kv_release_after=args.kv_release_after, idle=args.idle,
                         sample_interval=args.sample_interval, seed=args.seed,
                         kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales)
    console = Console(soft_wrap=True)  # plain lines are not cut at 80 columns when piped
    if not console.is_terminal:
        console.width = max(console.width, 120)  # a log file gets the whole table
    try:
        with _progress(console) as progress:
            result = run_bench(config, progress)
    except KeyboardInterrupt:  # while loading or checking: nothing measured to write
        console.print("stopped before any timing ran; nothing written")
        return 130
    return report(result, console)


def report(result, console) -> int:
    from . import report as files
    from .plot import plot_folder

    console.print(result.check.summary(), highlight=False)
    if result.agreement is not None:
        console.print(result.agreement.summary(), highlight=False)
    out = result.config.out
    written = [files.write_json(result, out / "summary.json")]
    if not result.check.passed:
        console.print(f"not timed: the outputs are wrong. Details in {written[0]}")
        return 1
    if result.samples:
        written.append(files.write_csv(result.samples, out / "memory.csv"))
        try:
            written.append(plot_folder(out))
        except ImportError as exc:  # the numbers are in the CSV; the picture can be drawn elsewhere
            console.print(f"no memory.png: {exc}; pip install 'ponytail[bench]', then python -m "
                          f"ponytail.bench.plot {out}", highlight=False)
    console.print(files.speed_table(result))
    for line in files.estimate_lines(result):
        console.print(line, highlight=False)
    if result.interrupted:
        console.print("[yellow]stopped by Ctrl-C: the numbers cover what ran before it[/yellow]")
    console.print("wrote " + ", ".join(str(p) for p in written), highlight=False)
    return 130 if result.interrupted else 0


class _progress:
    """A rich progress bar over requests, one task per phase (check, generate, ponytail)."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

        self._bar = RichProgress(TextColumn("{task.description:>14}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=False)
        self._task = None

    def __enter__(self) -> Progress:
        self._bar.__enter__()

        def phase(name: str, total: int) -> None:
            self._task = self._bar.add_task(name, total=total or None)

        def advance(n: int) -> None:
            if self._task is not None:
                self._bar.advance(self._task, n)

        return Progress(phase=phase, advance=advance)

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)
