"""The memory timeline as a PNG: one panel per side on the same memory scale, Ponytail's pool
(size, used blocks, what the live tokens need) on the same time axis as the device's memory.

    python -m ponytail.bench.plot DIR    # draw DIR/memory.png again from DIR/memory.csv
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from .memory import MemorySample, PoolSnapshot

GB = 1e9
SIDE_TITLES = {"generate": "plain model.generate (DynamicCache)", "ponytail": "Ponytail (paged KV pool)"}


def plot_memory(samples: list[MemorySample], path: Path, title: str, estimate_bytes: int | None = None) -> Path:
    """Write the PNG; estimate_bytes: `ponytail estimate`'s KV prediction, drawn beside the KV pool."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    sides = [s for s in SIDE_TITLES if any(m.side == s for m in samples)]
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
        if estimate_bytes is not None and side == "ponytail":
            ax.axhline(estimate_bytes / GB, color="grey", linestyle=":", linewidth=1,
                       label="KV predicted by ponytail estimate")
        ax.set_title(SIDE_TITLES[side])
        ax.set_xlabel("seconds since the side started")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    axes[0][0].set_ylabel("GB")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
    c, e = summary["config"], summary.get("estimate")
    predicted = None
    if e:
        predicted = min(e["total_bytes_blocks"], e["gpu_memory"]) if e["gpu_memory"] else e["total_bytes_blocks"]
    title = (f"{summary['device']}, {summary['dtype']}: {c['requests']} requests ({c['workload']}), "
             f"prompt <= {c['prompt_len']}, output <= {c['output_len']} tokens")
    return plot_memory(read_csv(folder / "memory.csv"), folder / "memory.png", title, predicted)


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
