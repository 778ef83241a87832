"""The memory timeline as a PNG: one panel per side on the same memory scale, Ponytail's pool
(size, used blocks, what the live tokens need) on the same time axis as the device's memory.

With several Ponytail sides (--kv-cache-dtype fp8: K/V in the model's dtype, then in FP8) the
sides share each axis instead, one line per side, so the dtypes compare at a glance: device memory
(with plain generate), the KV pool and its used blocks, and the requests running.

    python -m ponytail.bench.plot DIR    # draw DIR/memory.png again from DIR/memory.csv
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from .memory import MemorySample, PoolSnapshot

GB = 1e9
MB = 1e6
SIDE_TITLES = {"generate": "plain model.generate (DynamicCache)", "ponytail": "Ponytail (paged KV pool)"}
SIDE_LEGENDS = {"generate": "plain generate"}


def plot_memory(samples: list[MemorySample], path: Path, title: str, predicted: dict[str, int] | None = None,
                labels: dict[str, str] | None = None) -> Path:
    """Write the PNG. predicted: side -> `ponytail estimate`'s KV prediction, drawn beside its pool;
    labels: side -> what it adds to the side's name (a Ponytail side's KV dtype)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    predicted, labels = predicted or {}, labels or {}
    sides = list(dict.fromkeys(m.side for m in samples))  # in the order they ran
    engines = [s for s in sides if any(m.pool for m in samples if m.side == s)]
    if len(engines) > 1:
        fig = _compare_sides(plt, samples, sides, engines, predicted, labels)
    else:
        fig = _panel_per_side(plt, samples, sides, predicted, labels)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _panel_per_side(plt, samples, sides, predicted, labels):
    """One panel per side, every measure of that side in it (one Ponytail side)."""
    fig, axes = plt.subplots(1, max(1, len(sides)), figsize=(6.5 * max(1, len(sides)), 4.5), sharey=True,
                             squeeze=False)
    for ax, side in zip(axes[0], sides):
        rows = [m for m in samples if m.side == side]
        t = [m.t for m in rows]
        series = {
            "device used (NVML)": [m.device_used for m in rows],
            "torch reserved": [m.reserved for m in rows],
            "torch allocated": [m.allocated for m in rows],
            "process RSS": [m.rss for m in rows],
            "KV pool": [m.pool.pool_bytes if m.pool else None for m in rows],
            "KV used blocks": [m.pool.used_bytes if m.pool else None for m in rows],
            "KV live-token need": [m.pool.live_token_bytes if m.pool else None for m in rows],
        }
        for label, values in series.items():
            if all(v is None for v in values):
                continue
            style = "--" if label.startswith("KV") else "-"
            ax.plot(t, [float("nan") if v is None else v / GB for v in values], style, label=label, linewidth=1.4)
        if side in predicted:
            ax.axhline(predicted[side] / GB, color="grey", linestyle=":", linewidth=1,
                       label="KV predicted by ponytail estimate")
        title = SIDE_TITLES.get(side, f"Ponytail: {side}")
        ax.set_title(f"{title}, {labels[side]}" if side in labels else title, fontsize=10)
        ax.set_xlabel("seconds since the side started")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    axes[0][0].set_ylabel("GB")
    return fig


def _compare_sides(plt, samples, sides, engines, predicted, labels):
    """Three panels over one time axis, one line per side in each: the device's memory, the KV pool
    (solid) with its used blocks (dashed), and the requests running."""
    fig, (mem_ax, kv_ax, run_ax) = plt.subplots(3, 1, figsize=(10, 10), sharex=True,
                                                gridspec_kw={"height_ratios": [3, 3, 2]})
    colors = {side: f"C{i}" for i, side in enumerate(sides)}
    rows = {side: [m for m in samples if m.side == side] for side in sides}
    name = {side: SIDE_LEGENDS.get(side, side) + (f" ({labels[side]})" if side in labels else "") for side in sides}
    measure = next((k for k in ("device_used", "reserved", "rss")
                    if any(getattr(m, k) is not None for m in samples)), None)
    for side in sides:
        values = [getattr(m, measure) if measure else None for m in rows[side]]
        mem_ax.plot([m.t for m in rows[side]], [float("nan") if v is None else v / GB for v in values],
                    color=colors[side], label=name[side], linewidth=1.4)
    mem_ax.set_title({"device_used": "device memory in use (NVML)", "reserved": "torch reserved",
                      "rss": "process RSS"}.get(measure, "memory"), fontsize=10)
    mem_ax.set_ylabel("GB")
    peak = max((m.pool.pool_bytes for side in engines for m in rows[side]), default=0)
    unit, scale = ("GB", GB) if peak >= GB else ("MB", MB)  # a CPU run's pool is megabytes
    for side in engines:
        t = [m.t for m in rows[side]]
        # The other panels' legends name the dtypes; here the side's name keeps the legend off the lines.
        kv_ax.plot(t, [m.pool.pool_bytes / scale for m in rows[side]], color=colors[side], linewidth=1.6,
                   label=f"{side}: pool")
        kv_ax.plot(t, [m.pool.used_bytes / scale for m in rows[side]], "--", color=colors[side], linewidth=1.2,
                   label=f"{side}: used blocks")
        if side in predicted:
            kv_ax.axhline(predicted[side] / scale, color=colors[side], linestyle=":", linewidth=1,
                          label=f"{side}: estimate")
        run_ax.step(t, [m.pool.running for m in rows[side]], where="post", color=colors[side], label=name[side],
                    linewidth=1.4)
    kv_ax.set_title("Ponytail's KV pool (same --kv-cache-memory budget)", fontsize=10)
    kv_ax.set_ylabel(unit)
    run_ax.set_title("requests running at once", fontsize=10)
    run_ax.set_ylabel("requests")
    run_ax.set_xlabel("seconds since the side started")
    for ax in (mem_ax, kv_ax, run_ax):
        low, high = ax.get_ylim()
        ax.set_ylim(low, high + (high - low) * 0.45)  # room above the lines for the legend
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right", ncol=len(engines) if ax is kv_ax else 1)
    return fig


def read_csv(path: Path) -> list[MemorySample]:
    """The samples report.write_csv wrote, back as MemorySample."""
    def num(cell: str) -> int | None:
        return int(cell) if cell else None

    samples = []
    with path.open() as f:
        for row in csv.DictReader(f):
            pool = None
            if row["kv_pool_bytes"]:
                pool = PoolSnapshot(int(row["kv_pool_bytes"]), int(row["kv_used_bytes"]),
                                    int(row["kv_live_token_bytes"]), int(row["running"]), int(row["waiting"]))
            samples.append(MemorySample(row["side"], float(row["t_s"]), num(row["device_used_bytes"]),
                                        num(row["torch_allocated_bytes"]), num(row["torch_reserved_bytes"]),
                                        num(row["rss_bytes"]), pool))
    return samples


def plot_folder(folder: Path) -> Path:
    """Draw folder/memory.png from the memory.csv and summary.json `ponytail bench` wrote there."""
    summary = json.loads((folder / "summary.json").read_text())
    c = summary["config"]
    engines = summary.get("engines") or {"ponytail": {"estimate": summary.get("estimate")}}
    predicted = {side: _predicted(e["estimate"]) for side, e in engines.items() if e.get("estimate")}
    labels = {side: f"KV {e['kv_dtype']}" + (f", scales {e['scales']}" if e.get("scales") else "")
              for side, e in engines.items() if e.get("kv_dtype")}
    title = (f"{summary['device']}, {summary['dtype']}: {c['requests']} requests ({c['workload']}), "
             f"prompt <= {c['prompt_len']}, output <= {c['output_len']} tokens")
    return plot_memory(read_csv(folder / "memory.csv"), folder / "memory.png", title, predicted, labels)


def _predicted(e: dict) -> int:
    """The KV peak an estimate predicts: what the sequences need, capped by the budget."""
    return min(e["total_bytes_blocks"], e["gpu_memory"]) if e["gpu_memory"] else e["total_bytes_blocks"]


def main(argv: list[str] | None = None) -> int:
    """Redraw a bench directory's PNG (e.g. from a CSV brought back from a machine without matplotlib)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ponytail.bench.plot DIR  (DIR holds memory.csv and summary.json)", file=sys.stderr)
        return 2
    print(plot_folder(Path(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
