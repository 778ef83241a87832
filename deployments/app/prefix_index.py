"""One engine replica's prefix cache as a router knows it: block hashes, most recently seen last.

Two sources fill it: the replica's reports (prefix_publisher.py: hashes stored and dropped, with
sequence numbers) and this router's own sends, added the moment a replica is chosen so that a
burst of requests with one prefix already sees it there. A send the engine never caches (aborted
before its prefill) stays until the replica drops that hash or the index outgrows the replica's
pool; the router only ever reads it as a hint.

It also remembers which of those blocks a routed request has hit since they were stored: the
share of such blocks is what an eviction there is likely to cost (a cache full of one-off prompts
costs nothing to evict; one full of shared system prompts and live sessions does).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from .routing_stats import STAT_PREFIX_EVENTS, STAT_PREFIX_SEQ


class PrefixIndex:
    """Hashes of the prefix blocks one replica holds (or soon will), bounded by its pool size."""

    def __init__(self, capacity: int = 1 << 20):
        self.capacity = capacity  # at most this many hashes: the replica's whole pool
        self.seq = 0  # the newest report event applied
        self.num_resets = 0  # times reports skipped events and the index started over
        self._hashes: OrderedDict[int, None] = OrderedDict()
        self._reused: set[int] = set()  # held hashes a routed request has hit since they were stored

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._hashes

    def apply_report(self, stats: dict, total_blocks: int = 0) -> None:
        """The events in a replica's routing stats that this index has not applied yet. Events it
        missed (more than the reports repeat) make it start over from what the report carries."""
        if total_blocks > 0:
            self.capacity = total_blocks
        try:
            seq, events = int(stats[STAT_PREFIX_SEQ]), stats[STAT_PREFIX_EVENTS]
        except (KeyError, TypeError, ValueError):
            return  # a replica that does not publish its prefix cache: the index keeps our sends only
        if seq <= self.seq:
            return
        first = seq - len(events) + 1
        if first > self.seq + 1:
            self._hashes.clear()
            self._reused.clear()
            self.num_resets += 1
        for block_hash, stored in events[max(0, self.seq + 1 - first):]:
            if stored:
                self._touch(block_hash)
            else:
                self._hashes.pop(block_hash, None)
                self._reused.discard(block_hash)
        self.seq = seq
        self._trim()

    def add(self, hashes: Iterable[int]) -> None:
        """A prompt routed to the replica: its blocks are cached there once it is prefilled."""
        for block_hash in hashes:
            self._touch(block_hash)
        self._trim()

    def mark_reused(self, hashes: Iterable[int]) -> None:
        """Blocks a routed request found here (its hits)."""
        self._reused.update(h for h in hashes if h in self._hashes)

    @property
    def reuse_share(self) -> float:
        """Share of the held blocks that some routed request has hit: 0.0 when none are held."""
        return len(self._reused) / len(self._hashes) if self._hashes else 0.0

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks of a prompt (its chain hashes, in order) found here."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._hashes:
                break
            count += 1
        return count

    def _touch(self, block_hash: int) -> None:
        self._hashes[block_hash] = None
        self._hashes.move_to_end(block_hash)

    def _trim(self) -> None:
        while len(self._hashes) > self.capacity:
            self._reused.discard(self._hashes.popitem(last=False)[0])
