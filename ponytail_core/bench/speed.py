"""Speed of one side from per-request timings: output tokens/s, TTFT and TPOT percentiles."""

from __future__ import annotations

import math
from dataclasses import dataclass

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """One request, in seconds from the side's start."""

    first_token: float | None  # when its first output token was known; None if it had none
    last_token: float | None  # when its last output token was known
    output_tokens: int  # output tokens it produced


@dataclass(frozen=True, slots=True)
class SpeedStats:
    side: str
    seconds: float  # wall time of the run
    requests_done: int  # requests that produced all their tokens
    requests: int  # requests offered
    output_tokens: int  # output tokens produced, partial requests included
    ttft: dict[int, float]  # percentile -> seconds to first token
    tpot: dict[int, float]  # percentile -> seconds per output token after the first
    interrupted: bool  # Ctrl-C stopped the run: these numbers cover what ran
    note: str = ""  # why the numbers are missing or partial, for people

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else math.nan


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def speed_stats(side: str, timings: list[RequestTiming], seconds: float, requests: int, done: int,
                interrupted: bool, note: str = "") -> SpeedStats:
    ttfts = [t.first_token for t in timings if t.first_token is not None]
    tpots = [(t.last_token - t.first_token) / (t.output_tokens - 1)
             for t in timings if t.first_token is not None and t.output_tokens > 1]
    return SpeedStats(side=side, seconds=seconds, requests_done=done, requests=requests,
                      output_tokens=sum(t.output_tokens for t in timings),
                      ttft={q: percentile(ttfts, q) for q in PERCENTILES},
                      tpot={q: percentile(tpots, q) for q in PERCENTILES},
                      interrupted=interrupted, note=note)
