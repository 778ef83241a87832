"""What `ponytail bench` leaves behind: the memory CSV, a JSON summary, and the tables printed
with rich (speed side by side, and the estimate beside the measured peak)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

from ..utils.units import format_bytes
from .memory import MemorySample
from .run import BenchResult
from .speed import PERCENTILES, SpeedStats

CSV_COLUMNS = ("side", "t_s", "device_used_bytes", "torch_allocated_bytes", "torch_reserved_bytes", "rss_bytes",
               "kv_pool_bytes", "kv_used_bytes", "kv_live_token_bytes", "running", "waiting")
SIDE_NAMES = {"generate": "plain generate", "ponytail": "ponytail"}


def write_csv(samples: list[MemorySample], path: Path) -> Path:
    """One row per memory sample; empty cells where a count does not apply (no NVML, no pool)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for m in samples:
            pool = m.pool
            writer.writerow([m.side, f"{m.t:.4f}", _cell(m.device_used), _cell(m.allocated), _cell(m.reserved),
                             _cell(m.rss), *(_cell(getattr(pool, f, None)) for f in
                                             ("pool_bytes", "used_bytes", "live_token_bytes", "running", "waiting"))])
    return path


def _cell(value) -> str:
    return "" if value is None else str(value)


def memory_measure(m: MemorySample) -> int | None:
    """The sample's headline number: the whole device (NVML), else what torch holds, else RSS."""
    for value in (m.device_used, m.reserved, m.rss):
        if value is not None:
            return value
    return None


def side_memory(samples: list[MemorySample], side: str) -> tuple[int, int] | None:
    """(peak, peak minus the value when the side started) of the headline number, or None."""
    values = [v for v in (memory_measure(m) for m in samples if m.side == side) if v is not None]
    return (max(values), max(values) - values[0]) if values else None


def summary_dict(result: BenchResult) -> dict:
    """Everything measured, JSON-ready (written as summary.json)."""
    return {
        "device": result.device, "dtype": result.dtype, "memory_source": result.memory_source,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(result.config).items()},
        "weights_bytes": result.weights_bytes, "interrupted": result.interrupted,
        "output_check": result.check.to_dict(),
        "speed": {side: {**dataclasses.asdict(s), "tokens_per_s": _num(s.tokens_per_s)}
                  for side, s in result.speeds.items()},
        "notes": result.notes,
        "memory": {side: dict(zip(("peak_bytes", "peak_above_start_bytes"), side_memory(result.samples, side)))
                   for side in SIDE_NAMES if side_memory(result.samples, side)},
        "kv_budget_bytes": result.kv_budget_bytes, "kv_pool_peak_bytes": result.kv_pool_peak_bytes,
        "peak_running": result.peak_running,
        "estimate": result.estimate.to_dict() if result.estimate else None,
    }


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


def write_json(result: BenchResult, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # NaN percentiles (no request got that far) become null, not invalid JSON.
    path.write_text(json.dumps(_nan_to_none(summary_dict(result)), indent=2) + "\n")
    return path


def _nan_to_none(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {str(k): _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return value


def speed_table(result: BenchResult):
    """rich Table: one row per measure, one column per side, and Ponytail's ratio to generate."""
    from rich.table import Table

    sides = [s for s in SIDE_NAMES if s in result.speeds or s in result.notes]
    table = Table(title=f"{result.device}, {result.dtype}, {len(result.workload.prompts)} requests "
                        f"({result.workload.kind}), memory from {result.memory_source}")
    table.add_column("")
    for side in sides:
        table.add_column(SIDE_NAMES[side], justify="right")
    ratio = "generate" in result.speeds and "ponytail" in result.speeds
    if ratio:
        table.add_column("ponytail / generate", justify="right")

    def row(label, get, fmt, with_ratio=True):
        values = [get(result.speeds[s]) if s in result.speeds else None for s in sides]
        cells = ["-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt(v) for v in values]
        if ratio and not with_ratio:
            cells.append("")
        elif ratio:
            a, b = get(result.speeds["ponytail"]), get(result.speeds["generate"])
            cells.append(f"{a / b:.2f}x" if a and b and not math.isnan(a) and not math.isnan(b) else "-")
        table.add_row(label, *cells)

    row("output tokens/s", lambda s: s.tokens_per_s, lambda v: f"{v:,.1f}")
    for q in PERCENTILES:
        row(f"TTFT p{q} (s)", lambda s, q=q: s.ttft[q], lambda v: f"{v:.3f}")
    for q in PERCENTILES:
        row(f"TPOT p{q} (ms)", lambda s, q=q: s.tpot[q] * 1e3, lambda v: f"{v:.1f}")
    row("requests finished", lambda s: s.requests_done, lambda v: f"{v}/{len(result.workload.prompts)}",
        with_ratio=False)
    for label, index in (("peak memory", 0), ("peak above the start", 1)):
        cells = []
        for side in sides:
            mem = side_memory(result.samples, side)
            cells.append(format_bytes(mem[index]) if mem else "-")
        table.add_row(label, *cells, *([""] if ratio else []))
    table.add_row("notes", *[result.notes.get(s) or (result.speeds[s].note if s in result.speeds else "")
                             for s in sides], *([""] if ratio else []))
    return table


def estimate_lines(result: BenchResult) -> list[str]:
    """`ponytail estimate`'s prediction for the run's shape and budget, beside what was measured."""
    e = result.estimate
    if e is None:
        return []
    command = (f"ponytail estimate --num-layers {e.num_layers} --num-kv-heads {e.num_kv_heads} --head-dim "
               f"{e.head_dim} --dtype {e.dtype} --max-batch-size {e.max_batch_size} --max-seq-len {e.max_seq_len} "
               f"--block-size {e.block_size} --gpu-memory {e.gpu_memory}")
    predicted = min(e.total_bytes_blocks, e.gpu_memory) if e.gpu_memory else e.total_bytes_blocks
    lines = [f"estimate ({command}):",
             f"  {e.max_batch_size} sequences of {e.max_seq_len} tokens need {format_bytes(e.total_bytes_blocks)} "
             f"of KV; the budget {format_bytes(e.gpu_memory)} holds {e.max_concurrent_seqs} of them at once: "
             f"predicted KV peak {format_bytes(predicted)}"]
    if result.kv_pool_peak_bytes is not None:
        lines.append(f"  measured: KV pool peak {format_bytes(result.kv_pool_peak_bytes)} "
                     f"({result.kv_pool_peak_bytes / predicted:.2f}x the prediction), up to "
                     f"{result.peak_running} requests running at once")
    for side in SIDE_NAMES:
        mem = side_memory(result.samples, side)
        if mem:
            lines.append(f"  {SIDE_NAMES[side]}: peak {format_bytes(mem[0])} ({result.memory_source}), "
                         f"{format_bytes(mem[1])} above its start; weights {format_bytes(result.weights_bytes)}")
    return lines
