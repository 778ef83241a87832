"""Prefix-cache changes in order, for a reader in another process (a router placing requests where
their prefix is cached): each full block hash offered to the prefix cache, and each one dropped.

The allocator records into a PrefixEventLog only when one is attached, so an engine nobody routes
for pays nothing. Appends come from the engine's step thread and reads from another thread: a
deque append is atomic, and every event carries its own sequence number, so a reader's copy is
consistent whatever it raced with.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..errors import ConfigError


@dataclass(slots=True, frozen=True)
class PrefixEvent:
    seq: int  # 1 for the first event recorded, then +1 each
    block_hash: int  # the block's chain hash (prefix_block_hashes computes the same)
    stored: bool  # True: now in the prefix cache; False: dropped (evicted, or its block released)


@dataclass(slots=True)
class PrefixEventLog:
    """The last `capacity` prefix-cache events; older ones are forgotten (readers see the gap)."""

    capacity: int = 65536
    events: deque[PrefixEvent] = field(init=False)
    seq: int = 0  # events ever recorded; the newest event's seq

    def __post_init__(self):
        if not isinstance(self.capacity, int) or isinstance(self.capacity, bool) or self.capacity < 1:
            raise ConfigError(f"capacity={self.capacity!r} is not supported; allowed: an int >= 1 (events kept)")
        self.events = deque(maxlen=self.capacity)

    def record(self, block_hash: int, stored: bool) -> None:
        self.seq += 1
        self.events.append(PrefixEvent(self.seq, block_hash, stored))

    def extend(self, events: list[PrefixEvent]) -> None:
        """Append another log's events as they are, sequence numbers and gaps included (a copy of
        an engine's log in another process)."""
        if events:
            self.events.extend(events)
            self.seq = events[-1].seq

    def since(self, seq: int) -> list[PrefixEvent]:
        """Events newer than `seq`, oldest first; the first one's seq > seq + 1 when some were forgotten."""
        events = list(self.events)  # one C-level copy: no step-thread append can interleave
        if not events or events[-1].seq <= seq:
            return []
        start = max(0, len(events) - (events[-1].seq - seq))
        return events[start:]
