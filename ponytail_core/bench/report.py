"""What `ponytail bench` leaves behind: the memory CSV, a JSON summary, and the tables printed
with rich (speed side by side, and the estimate beside the measured peak).

Sides: "generate" (plain model.generate), "ponytail" (K/V in the model's dtype) and, with
--kv-cache-dtype fp8, "ponytail fp8": the same engine storing K/V in FP8 under the same budget."""

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
SIDE_NAMES = {"generate": "plain generate"}  # a column's header where it is not the side's own name


def sides(result: BenchResult) -> list[str]:
    """Every side that ran or was meant to, in the order they ran: generate, then each Ponytail side."""
    ordered = ["generate"] + [side for side, _ in result.config.engine_sides()]
    present = {m.side for m in result.samples} | set(result.speeds) | set(result.notes) | set(result.engines)
    return [side for side in ordered if side in present]


def ratios(result: BenchResult) -> list[tuple[str, str, str]]:
    """(numerator side, denominator side, column header) for the ratio columns that have both sides."""
    engine_sides = result.config.engine_sides()
    pairs = [("ponytail", "generate", "ponytail / generate")]
    if len(engine_sides) > 1:
        pairs.append((engine_sides[1][0], engine_sides[0][0], f"{engine_sides[1][1]} / auto"))
    return [(a, b, h) for a, b, h in pairs if a in result.speeds and b in result.speeds]


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
    auto = result.engines.get("ponytail")
    return {
        "device": result.device, "dtype": result.dtype, "memory_source": result.memory_source,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(result.config).items()},
        "weights_bytes": result.weights_bytes, "interrupted": result.interrupted,
        "output_check": result.check.to_dict(),
        "speed": {side: {**dataclasses.asdict(s), "tokens_per_s": _num(s.tokens_per_s)}
                  for side, s in result.speeds.items()},
        "notes": result.notes,
        "memory": {side: dict(zip(("peak_bytes", "peak_above_start_bytes"), side_memory(result.samples, side)))
                   for side in sides(result) if side_memory(result.samples, side)},
        # The auto side's pool at the top level, as before FP8 sides existed; every side's under "engines".
        "kv_budget_bytes": auto.budget_bytes if auto else None,
        "kv_pool_peak_bytes": auto.pool_peak_bytes if auto else None,
        "peak_running": auto.peak_running if auto else None,
        "estimate": auto.estimate.to_dict() if auto and auto.estimate else None,
        "engines": {side: {**{k: v for k, v in dataclasses.asdict(e).items() if k != "estimate"},
                           "estimate": e.estimate.to_dict() if e.estimate else None}
                    for side, e in result.engines.items()},
        "kv_agreement": result.agreement.to_dict() if result.agreement else None,
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
    """rich Table: one row per measure, one column per side, then the ratio columns (Ponytail to
    plain generate; with FP8, the FP8 side to the auto side)."""
    from rich.table import Table

    columns = [s for s in sides(result) if s in result.speeds or s in result.notes]
    pairs = ratios(result)
    table = Table(title=f"{result.device}, {result.dtype}, {len(result.workload.prompts)} requests "
                        f"({result.workload.kind}), memory from {result.memory_source}")
    table.add_column("", no_wrap=True)  # measure names whole; the notes wrap instead
    for side in columns:
        table.add_column(SIDE_NAMES.get(side, side), justify="right")
    for _, _, header in pairs:
        table.add_column(header, justify="right", no_wrap=True)

    def add(label, values: dict, fmt, with_ratio=True):
        """values: side -> number, None where the side has no such measure (no ratio either)."""
        cells = ["-" if _missing(values.get(s)) else fmt(values[s]) for s in columns]
        for a, b, _ in pairs:
            x, y = values.get(a), values.get(b)
            if not with_ratio or x is None or y is None:
                cells.append("")
            else:
                cells.append("-" if _missing(x) or _missing(y) or not y else f"{x / y:.2f}x")
        table.add_row(label, *cells)

    def speed(get):
        return {s: get(result.speeds[s]) for s in columns if s in result.speeds}

    add("output tokens/s", speed(lambda s: s.tokens_per_s), lambda v: f"{v:,.1f}")
    for q in PERCENTILES:
        add(f"TTFT p{q} (s)", speed(lambda s, q=q: s.ttft[q]), lambda v: f"{v:.3f}")
    for q in PERCENTILES:
        add(f"TPOT p{q} (ms)", speed(lambda s, q=q: s.tpot[q] * 1e3), lambda v: f"{v:.1f}")
    add("requests finished", speed(lambda s: s.requests_done), lambda v: f"{v}/{len(result.workload.prompts)}",
        with_ratio=False)
    for label, index in (("peak memory", 0), ("peak above the start", 1)):
        mems = {s: side_memory(result.samples, s) for s in columns}
        add(label, {s: m[index] for s, m in mems.items() if m}, format_bytes, with_ratio=False)
    engines = {s: result.engines[s] for s in columns if s in result.engines}
    if engines:
        table.add_row("KV stored as", *[engines[s].kv_dtype if s in engines else "-" for s in columns],
                      *[""] * len(pairs))
        add("KV pool holds (tokens)", {s: e.capacity_tokens for s, e in engines.items()}, lambda v: f"{v:,}")
        add("KV pool peak", {s: e.pool_peak_bytes for s, e in engines.items()}, format_bytes)
        add("most running at once", {s: e.peak_running for s, e in engines.items()}, str)
    table.add_row("notes", *[result.notes.get(s) or (result.speeds[s].note if s in result.speeds else "")
                             for s in columns], *[""] * len(pairs))
    return table


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def estimate_lines(result: BenchResult) -> list[str]:
    """`ponytail estimate`'s prediction for the run's shape and budget, beside what was measured,
    for each Ponytail side (the FP8 one with its own dtype), then each side's memory."""
    lines = []
    for side, engine in result.engines.items():
        e = engine.estimate
        if e is None:
            continue
        dtype_flag = "" if e.kv_cache_dtype == "auto" else f" --kv-cache-dtype {e.kv_cache_dtype}"
        command = (f"ponytail estimate --num-layers {e.num_layers} --num-kv-heads {e.num_kv_heads} --head-dim "
                   f"{e.head_dim} --dtype {e.dtype}{dtype_flag} --max-batch-size {e.max_batch_size} --max-seq-len "
                   f"{e.max_seq_len} --block-size {e.block_size} --gpu-memory {e.gpu_memory}")
        predicted = min(e.total_bytes_blocks, e.gpu_memory) if e.gpu_memory else e.total_bytes_blocks
        lines += [f"estimate ({command}):",
                  f"  {e.max_batch_size} sequences of {e.max_seq_len} tokens need {format_bytes(e.total_bytes_blocks)} "
                  f"of KV; the budget {format_bytes(e.gpu_memory)} holds {e.max_concurrent_seqs} of them at once: "
                  f"predicted KV peak {format_bytes(predicted)}"]
        if engine.pool_peak_bytes is not None:
            lines.append(f"  measured, {side} ({engine.label}): KV pool peak {format_bytes(engine.pool_peak_bytes)} "
                         f"({engine.pool_peak_bytes / predicted:.2f}x the prediction), up to "
                         f"{engine.peak_running} requests running at once; the pool holds "
                         f"{engine.capacity_tokens:,} tokens")
    for side in sides(result):
        mem = side_memory(result.samples, side)
        if mem:
            lines.append(f"  {SIDE_NAMES.get(side, side)}: peak {format_bytes(mem[0])} ({result.memory_source}), "
                         f"{format_bytes(mem[1])} above its start; weights {format_bytes(result.weights_bytes)}")
    return lines
