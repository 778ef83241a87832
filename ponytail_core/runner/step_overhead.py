"""What a step with a prompt chunk costs beyond the CUDA-graph decode step it displaces, measured
once at start-up, so the scheduler holds new prompts no longer than sharing a step can save.

prefill_delay_factor holds new prompts while requests decode, so that prompts arriving close
together share one eager step and the decode steps between them replay graphs. What sharing saves
is each extra eager step's fixed cost over the replay it displaces: the host's dispatch of every
layer's modules and kernels, which a replay skips (tens of milliseconds, about the same for a
135M and a 7B-shaped model with compiled layers). Holding a
prompt longer than that saving adds time to its first token that no sharing pays back (the
ski-rental bound), so the scheduler holds prompts for factor x this overhead at the step's decode
rows. The last prefill step's whole duration (vLLM v0's rule, the fallback where nothing was
measured) also counts the prompts' own compute, which sharing does not save: a 7B model's
prefill steps held every prompt for the 0.1 s cap.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

PROMPT_TOKENS = 16  # the measured step's prompt chunk: its own compute is small next to a step's fixed cost
REPEATS = 5  # timed pairs per row count (the median is kept)


@dataclass(frozen=True, slots=True)
class StepOverhead:
    rows: tuple[int, ...]  # decode rows measured, ascending
    seconds: tuple[float, ...]  # per entry: an eager step of those rows and a prompt chunk, less their replay (>= 0)

    def at(self, rows: int) -> float:
        """Linear between the measured row counts; outside them, the nearest one's value."""
        if rows <= self.rows[0]:
            return self.seconds[0]
        for (r0, s0), (r1, s1) in pairwise(zip(self.rows, self.seconds)):
            if rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        return self.seconds[-1]

    def describe(self) -> str:
        return ", ".join(f"{s * 1e3:.2f} ms at {r} decode rows" for r, s in zip(self.rows, self.seconds))


def measure_step_overhead(eager_step: Callable[[int], object], graph_step: Callable[[int], object],
                          rows: Sequence[int], sync: Callable[[], object],
                          clock: Callable[[], float] = time.perf_counter, repeats: int = REPEATS) -> StepOverhead:
    """eager_step(n) / graph_step(n): queue a step of n decode rows, with / without a prompt chunk.
    Each is called once untimed per row count (lazy inits, compiles), then `repeats` pairs are
    timed from an idle device to an idle device; the median difference is kept, at least 0."""
    rows = sorted(set(rows))
    seconds = []
    for n in rows:
        eager_step(n)
        graph_step(n)
        differences = []
        for _ in range(repeats):
            sync()
            start = clock()
            eager_step(n)
            sync()
            middle = clock()
            graph_step(n)
            sync()
            differences.append((middle - start) - (clock() - middle))
        seconds.append(max(0.0, statistics.median(differences)))
    return StepOverhead(tuple(rows), tuple(seconds))
