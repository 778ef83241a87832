"""Block bookkeeping for the paged KV cache: which block holds which tokens of which sequence.

Pure Python and device-free: it hands out block ids and slot ids and says which blocks must be
copied (copy-on-write, compaction); `PagedKVCache` carries those copies out on the device.

A block is in exactly one of three states:
  * free       - no data; kept in a min-heap so new data lands in the lowest ids and the pool
                 stays compact (which is what lets it give its tail back);
  * used       - ref_count > 0, held by one or more sequences' block tables;
  * evictable  - ref_count == 0 but still holds a full block registered in the prefix-hash map,
                 so a later prompt with the same prefix can reuse it; evicted LRU when needed.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from ..utils.arith import cdiv
from .blocks import Allocation, Block, NoRoom, chain_hash
from .prefix_events import PrefixEventLog


@dataclass(slots=True)
class _SeqState:
    block_ids: list[int]
    num_tokens: int = 0
    last_hash: int | None = None  # hash of the last full block: the head of the chain
    partial_tokens: list[int] = field(default_factory=list)  # tokens in the last, partial block
    num_committed: int = 0  # leading blocks offered to the prefix cache (their K/V is written)
    sealed_tokens: tuple[int, ...] = ()  # tokens of the last full block, to seal it again (replace_token)
    sealed_after: int | None = None  # the chain hash that block was sealed after


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks} must be >= 0")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks))  # min-heap of ids
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self._hash_to_block: dict[int, int] = {}
        self._seqs: dict[object, _SeqState] = {}
        self.prefix_events: PrefixEventLog | None = None  # attached by whoever publishes the cache's content

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now, evictable prefix blocks included."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def high_water_mark(self) -> int:
        """One past the highest block id that holds data (used or evictable)."""
        free = set(self._free)
        for block_id in range(self.num_blocks - 1, -1, -1):
            if block_id not in free:
                return block_id + 1
        return 0

    @property
    def fragmentation(self) -> float:
        """Holes below the high-water mark over the high-water mark (0 = compact)."""
        hwm = self.high_water_mark
        return sum(1 for block_id in self._free if block_id < hwm) / hwm if hwm else 0.0

    def has_seq(self, seq_id) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list:
        return list(self._seqs)

    def block_table(self, seq_id, num_tokens: int | None = None) -> list[int]:
        """The sequence's blocks; with num_tokens, only those its first num_tokens tokens use."""
        block_ids = self._state(seq_id).block_ids
        return list(block_ids) if num_tokens is None else block_ids[: cdiv(num_tokens, self.block_size)]

    def seq_len(self, seq_id) -> int:
        return self._state(seq_id).num_tokens

    def slot(self, seq_id, position: int) -> int:
        return self._state(seq_id).block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, seq_id, start: int, stop: int) -> list[int]:
        """slot(seq_id, p) for p in start .. stop - 1."""
        block_ids, bs = self._state(seq_id).block_ids, self.block_size
        slots: list[int] = []
        for index in range(start // bs, cdiv(stop, bs) if stop > start else 0):  # block by block
            base = block_ids[index] * bs
            slots.extend(range(base + max(start - index * bs, 0), base + min(stop - index * bs, bs)))
        return slots

    # ------------------------------------------------------------- allocation
    def allocate(self, seq_id, token_ids: list[int], max_cached_tokens: int | None = None,
                 root_hash: int | None = None) -> Allocation | NoRoom:
        """Give a new sequence blocks for `token_ids`, reusing cached full blocks of its prefix.
        `max_cached_tokens` caps the reuse (an engine must still compute a prompt's last token);
        root_hash starts the chain (blocks.salt_root: another salt, other hashes)."""
        if seq_id in self._seqs:
            raise ValueError(f"seq_id={seq_id!r} is already allocated; free it or use append()")
        token_ids = list(token_ids)
        bs = self.block_size
        hits: list[int] = []
        prev_hash = root_hash
        limit = len(token_ids) if max_cached_tokens is None else min(len(token_ids), max_cached_tokens)
        if self.enable_prefix_caching:  # the chain prefix_block_hashes (blocks.py) computes elsewhere
            for start in range(0, limit - bs + 1, bs):
                block_tokens = tuple(token_ids[start : start + bs])
                h = chain_hash(prev_hash, block_tokens)
                block_id = self._hash_to_block.get(h)
                if block_id is None or self.blocks[block_id].token_ids != block_tokens:
                    break
                hits.append(block_id)
                prev_hash = h
        num_new = cdiv(len(token_ids), bs) - len(hits)
        reusable = sum(1 for b in hits if b in self._evictable)
        if num_new > self.num_free - reusable:
            return NoRoom(needed=num_new, free=self.num_free - reusable)

        for block_id in hits:
            self._evictable.pop(block_id, None)
            self.blocks[block_id].ref_count += 1
        num_cached = len(hits) * bs
        state = _SeqState(block_ids=list(hits), num_tokens=num_cached, last_hash=prev_hash,
                          num_committed=len(hits))
        self._seqs[seq_id] = state
        slots = self._extend(state, token_ids[num_cached:])
        return Allocation(slots=slots, copies=[], num_cached_tokens=num_cached)

    def blocks_needed_to_append(self, seq_id, num_tokens: int) -> int:
        state = self._state(seq_id)
        bs = self.block_size
        new_blocks = cdiv(state.num_tokens + num_tokens, bs) - len(state.block_ids)
        cow = 1 if self._last_block_is_shared_partial(state) and num_tokens > 0 else 0
        return new_blocks + cow

    def append(self, seq_id, token_ids: list[int]) -> Allocation | NoRoom:
        """Slots for `token_ids` after the sequence's tokens; a new block only at a boundary.

        A partial last block shared with a fork is first copied (copy-on-write).
        """
        state = self._state(seq_id)
        offset = state.num_tokens % self.block_size
        if len(token_ids) == 1 and offset and self.blocks[state.block_ids[-1]].ref_count == 1:
            return Allocation(slots=self._extend(state, token_ids), copies=[])  # a decode token in its own block
        token_ids = list(token_ids)
        needed = self.blocks_needed_to_append(seq_id, len(token_ids))
        if needed > self.num_free:
            return NoRoom(needed=needed, free=self.num_free)
        copies: list[tuple[int, int]] = []
        if token_ids and self._last_block_is_shared_partial(state):
            old = state.block_ids[-1]
            new = self._take_block()
            self.blocks[old].ref_count -= 1
            self.blocks[new].ref_count = 1
            state.block_ids[-1] = new
            copies.append((old, new))
        return Allocation(slots=self._extend(state, token_ids), copies=copies)

    def commit(self, seq_id, num_computed_tokens: int) -> None:
        """The sequence's first `num_computed_tokens` tokens now have their K/V written: offer its
        full blocks among them to the prefix cache. Until then no other sequence can hit them,
        so a hit never returns a block whose data is still to be computed."""
        state = self._state(seq_id)
        full = min(num_computed_tokens, state.num_tokens) // self.block_size
        for index in range(state.num_committed, full):
            block = self.blocks[state.block_ids[index]]
            if self.enable_prefix_caching and block.hash is not None \
                    and self._hash_to_block.setdefault(block.hash, block.block_id) == block.block_id \
                    and self.prefix_events is not None:
                self.prefix_events.record(block.hash, stored=True)
        state.num_committed = max(state.num_committed, full)

    def replace_token(self, seq_id, position: int, token: int) -> None:
        """Put `token` at `position`, in place of a placeholder appended before the token was known
        (async scheduling appends a step's sampled token before it reaches the host).

        Only the last block may change, and only before commit() offered it to other prompts. A
        last block the placeholder filled is sealed again: its hash (and the chain after it) is
        the one appending `token` in the first place would have given.
        """
        state = self._state(seq_id)
        bs = self.block_size
        index = position // bs
        if not 0 <= position < state.num_tokens or index != (state.num_tokens - 1) // bs:
            raise ValueError(f"position {position} is not in the last block of seq {seq_id!r} "
                             f"({state.num_tokens} tokens); only the last block's tokens can be replaced")
        if index < state.num_committed:
            raise ValueError(f"block {index} of seq {seq_id!r} is already offered to the prefix cache; "
                             "replace placeholders before commit()")
        if state.partial_tokens:
            state.partial_tokens[position % bs] = token
            return
        block = self.blocks[state.block_ids[-1]]
        if block.ref_count > 1:
            raise ValueError(f"the last block of seq {seq_id!r} is shared (fork); its tokens cannot change")
        tokens = list(state.sealed_tokens)
        tokens[position % bs] = token
        state.sealed_tokens = tuple(tokens)
        state.last_hash = chain_hash(state.sealed_after, state.sealed_tokens)
        if self.enable_prefix_caching:
            block.hash, block.token_ids = state.last_hash, state.sealed_tokens

    def fork(self, parent_id, child_id) -> None:
        """The child shares every block of the parent (ref counts go up, nothing is copied)."""
        parent = self._state(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"child_id={child_id!r} is already allocated")
        for block_id in parent.block_ids:
            self.blocks[block_id].ref_count += 1
        self._seqs[child_id] = _SeqState(
            block_ids=list(parent.block_ids),
            num_tokens=parent.num_tokens,
            last_hash=parent.last_hash,
            partial_tokens=list(parent.partial_tokens),
            num_committed=parent.num_committed,
            sealed_tokens=parent.sealed_tokens,
            sealed_after=parent.sealed_after,
        )

    def free(self, seq_id) -> None:
        """Drop a sequence; blocks nobody else holds become evictable (cached) or free."""
        state = self._seqs.pop(seq_id, None)
        if state is None:
            raise KeyError(f"seq_id={seq_id!r} is not allocated")
        # Tail first, so the LRU evicts a prompt's last blocks before its shared head.
        for block_id in reversed(state.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.hash is not None and self._hash_to_block.get(block.hash) == block_id:
                self._evictable[block_id] = None
            else:
                block.reset()
                heapq.heappush(self._free, block_id)

    # ------------------------------------------------------- capacity changes
    def grow(self, num_new_blocks: int) -> None:
        start = self.num_blocks
        for block_id in range(start, start + num_new_blocks):
            self.blocks.append(Block(block_id))
            heapq.heappush(self._free, block_id)

    def shrink(self, num_blocks_to_release: int) -> None:
        """Forget the top `num_blocks_to_release` ids; they must hold no live data."""
        new_total = self.num_blocks - num_blocks_to_release
        live = [b for b in range(new_total, self.num_blocks) if self.blocks[b].ref_count > 0]
        if live:
            raise ValueError(f"cannot release blocks {live[:8]}: still in use; compact first")
        for block_id in range(new_total, self.num_blocks):
            if block_id in self._evictable:
                del self._evictable[block_id]
                self._forget_hash(self.blocks[block_id].hash)
        del self.blocks[new_total:]
        self._free = [b for b in self._free if b < new_total]
        heapq.heapify(self._free)

    def evict(self, count: int) -> int:
        """Drop up to `count` cached prefix blocks, least recently used first; returns how many."""
        dropped = 0
        while dropped < count and self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget_hash(self.blocks[block_id].hash)
            self.blocks[block_id].reset()
            heapq.heappush(self._free, block_id)
            dropped += 1
        return dropped

    def plan_compaction(self) -> dict[int, int]:
        """Move every block holding data into the lowest ids with the fewest moves.

        Returns {src: dst} and remaps block tables, ref counts, the prefix-hash map and the
        LRU in the same step: the caller must copy the data before anything else runs.
        """
        occupied = self.num_blocks - len(self._free)  # used and evictable blocks both hold data
        free = set(self._free)
        movers = [b for b in range(occupied, self.num_blocks) if b not in free]
        holes = sorted(b for b in free if b < occupied)
        moves = dict(zip(movers, holes))
        if not moves:
            return moves
        for src, dst in moves.items():
            src_block, dst_block = self.blocks[src], self.blocks[dst]
            dst_block.ref_count, dst_block.hash, dst_block.token_ids = (
                src_block.ref_count, src_block.hash, src_block.token_ids)
            if dst_block.hash is not None and self._hash_to_block.get(dst_block.hash) == src:
                self._hash_to_block[dst_block.hash] = dst
            src_block.reset()
        for state in self._seqs.values():
            state.block_ids = [moves.get(b, b) for b in state.block_ids]
        self._evictable = OrderedDict((moves.get(b, b), None) for b in self._evictable)
        self._free = list(range(occupied, self.num_blocks))  # sorted, so already a heap
        return moves

    # --------------------------------------------------------------- checking
    def invariants(self) -> list[str]:
        """Every broken invariant as a sentence; an empty list means the state is consistent."""
        problems: list[str] = []
        free, evictable = set(self._free), set(self._evictable)
        if len(free) != len(self._free):
            problems.append("free heap holds duplicate ids")
        expected_refs = [0] * self.num_blocks
        for seq_id, state in self._seqs.items():
            for block_id in state.block_ids:
                if not 0 <= block_id < self.num_blocks:
                    problems.append(f"seq {seq_id!r} holds out-of-range block {block_id}")
                    continue
                expected_refs[block_id] += 1
            if len(state.block_ids) != cdiv(state.num_tokens, self.block_size):
                problems.append(f"seq {seq_id!r}: {len(state.block_ids)} blocks for {state.num_tokens} tokens")
            if len(state.partial_tokens) != state.num_tokens % self.block_size:
                problems.append(f"seq {seq_id!r}: partial tokens out of step with its length")
        for block in self.blocks:
            b = block.block_id
            states = (b in free) + (b in evictable) + (block.ref_count > 0)
            if states != 1:
                problems.append(f"block {b} is in {states} states (free/evictable/used)")
            if block.ref_count != expected_refs[b]:
                problems.append(f"block {b}: ref_count {block.ref_count}, held {expected_refs[b]} times")
            if b in free and (block.hash is not None or block.token_ids):
                problems.append(f"free block {b} still carries a hash")
            if b in evictable and self._hash_to_block.get(block.hash) != b:
                problems.append(f"evictable block {b} is not in the prefix-hash map")
        for h, b in self._hash_to_block.items():
            if not 0 <= b < self.num_blocks or self.blocks[b].hash != h:
                problems.append(f"prefix-hash entry {h} points at block {b} with another hash")
            elif b in free:
                problems.append(f"prefix-hash entry {h} points at free block {b}")
            elif min(self.blocks[b].token_ids, default=0) < 0:
                problems.append(f"prefix-hash entry {h} (block {b}) holds a negative token id: a placeholder "
                                "was committed before its token was known")
        return problems

    # ---------------------------------------------------------------- helpers
    def _state(self, seq_id) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"seq_id={seq_id!r} is not allocated") from None

    def _forget_hash(self, block_hash: int) -> None:
        del self._hash_to_block[block_hash]
        if self.prefix_events is not None:
            self.prefix_events.record(block_hash, stored=False)

    def _last_block_is_shared_partial(self, state: _SeqState) -> bool:
        return (state.num_tokens % self.block_size != 0
                and self.blocks[state.block_ids[-1]].ref_count > 1)

    def _take_block(self) -> int:
        if not self._free:
            self.evict(1)
        return heapq.heappop(self._free)

    def _extend(self, state: _SeqState, token_ids: list[int]) -> list[int]:
        """Place tokens after the sequence's end a block at a time, taking and sealing blocks."""
        bs, slots, done, total = self.block_size, [], 0, len(token_ids)
        while done < total:
            offset = state.num_tokens % bs
            if offset == 0:
                block_id = self._take_block()
                self.blocks[block_id].ref_count = 1
                state.block_ids.append(block_id)
            take = min(bs - offset, total - done)
            first = state.block_ids[-1] * bs + offset
            slots.extend(range(first, first + take))
            state.partial_tokens.extend(token_ids[done : done + take])
            state.num_tokens += take
            done += take
            if offset + take == bs:
                self._seal(state)
        return slots

    def _seal(self, state: _SeqState) -> None:
        """The last block just filled up: hash it (commit() later offers it to other prompts)."""
        tokens = tuple(state.partial_tokens)
        state.partial_tokens = []
        state.sealed_tokens, state.sealed_after = tokens, state.last_hash
        h = chain_hash(state.last_hash, tokens)
        state.last_hash = h
        if self.enable_prefix_caching:
            block = self.blocks[state.block_ids[-1]]
            block.hash, block.token_ids = h, tokens
