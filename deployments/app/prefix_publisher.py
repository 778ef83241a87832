"""What an engine replica tells the prefix-aware router about its prefix cache, incrementally.

Every routing-stats report carries the prefix-cache events (block hashes stored and dropped) of
the last REPORTS_KEPT reports, and the sequence number of the newest one. A router that reads
every report (or misses a few) applies the events it has not seen; one that missed more sees a
gap in the sequence numbers and starts that replica's index over. Idle, a report carries none.
"""

from __future__ import annotations

from collections import deque

from ponytail import PrefixEventLog

from .routing_stats import STAT_CACHED_BLOCKS, STAT_PREFIX_EVENTS, STAT_PREFIX_SEQ

REPORTS_KEPT = 10  # events repeat in this many reports: 2 s at the app's 0.2 s stats period
LOG_CAPACITY = 65536  # events the engine keeps between two reports at most (~4 MiB); more is a gap


class PrefixPublisher:
    """Slices the engine's prefix event log (`LLM.publish_prefix_events`) into reports."""

    def __init__(self, log: PrefixEventLog, reports_kept: int = REPORTS_KEPT):
        self.log = log
        self._report_seqs: deque[int] = deque([0], maxlen=reports_kept)  # newest seq at each recent report

    def routing_stats(self, cached_blocks: int, advance: bool = True) -> dict:
        """The prefix part of record_routing_stats(): events since REPORTS_KEPT reports ago.

        advance=False reads the same window without moving it, for readers other than the router
        (`ponytail replicas`, tests): otherwise each of their reads would push events the router
        has not seen yet out of its next report."""
        events = self.log.since(self._report_seqs[0])
        seq = events[-1].seq if events else self._report_seqs[-1]
        if advance:
            self._report_seqs.append(seq)
        return {STAT_PREFIX_SEQ: seq, STAT_PREFIX_EVENTS: [(e.block_hash, e.stored) for e in events],
                STAT_CACHED_BLOCKS: cached_blocks}
