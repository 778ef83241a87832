"""The paged KV cache: block bookkeeping + device storage + the elastic-pool policy.

Sequences take blocks as they grow and give them back when they finish; the pool grows a chunk
at a time within the memory budget and, when load falls, compacts live blocks into the lowest
ids and hands the freed tail back to the device.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from . import cache_ops
from .block_allocator import BlockAllocator
from .blocks import Allocation, NoRoom, salt_root
from .config import CacheConfig
from .storage import PagedKVStorage
from ..utils.arith import cdiv
from ..utils.device import to_device
from ..utils.units import format_bytes

logger = logging.getLogger("ponytail.kv")


@dataclass(frozen=True, slots=True)
class DefragResult:
    blocks_moved: int  # blocks copied to lower ids (each covers every layer, K and V)
    bytes_moved: int  # bytes copied on the device


@dataclass(frozen=True, slots=True)
class MaintenanceReport:
    chunks_added: int
    defrag: DefragResult | None  # None when fragmentation stayed under the threshold
    chunks_released: int


@dataclass(frozen=True, slots=True)
class CacheStats:
    total_blocks: int  # blocks the pool holds now
    max_blocks: int  # blocks the memory budget allows
    free_blocks: int  # allocatable now, evictable prefix blocks included
    used_blocks: int  # held by live sequences
    evictable_blocks: int  # cached prefix blocks nobody holds
    num_seqs: int
    high_water_mark: int
    fragmentation: float
    allocated_bytes: int  # device memory the pool holds


class PagedKVCache:
    """A paged KV cache for one model on one device. See `ponytail.create_cache`."""

    # Policy knobs (tuning values, not configuration most users touch).
    GROW_WHEN_FREE_BELOW = 0.05  # maintain() adds a chunk when free blocks fall under this share
    KEEP_FREE_CHUNKS = 1  # maintain() keeps this many chunks of free headroom when shrinking
    GROW_RETRY_S = 1.0  # after the device refused a chunk, growth waits this long before trying again

    def __init__(self, config: CacheConfig, initial_chunks: int = 1, release_after_s: float = 0.0,
                 enable_prefix_caching: bool = True, device_headroom_bytes: int = 0, keep_prefixes: bool = False):
        """enable_prefix_caching: full blocks serve later sequences with the same prefix (off for
        callers that address sequences by position, not content, like the transformers plug-in).
        device_headroom_bytes: CUDA memory growth must leave free for the model's steps
        (activations, workspaces), so the pool never starves the forward pass; 0: no check.
        keep_prefixes: grow within the budget rather than evict cached prefix blocks, and count
        them as held when giving memory back, until the pool has had no live sequence for
        release_after_s; then they go back with the rest. Off: the pool stays at what live
        sequences need and cached prefixes fill only its leftover blocks."""
        self.config = config
        # maintain() gives chunks back only once the pool has had them spare this long: a server
        # whose bursts come seconds apart keeps its working size instead of regrowing every burst.
        self.release_after_s = release_after_s
        self._spare_since: float | None = None  # when maintain() first saw chunks to spare, in a row
        self.keep_prefixes = keep_prefixes
        self._busy_at = -float("inf")  # time.monotonic() when maintain() last saw a live sequence
        chunk_blocks = config.pool_chunk_blocks
        self.max_chunks = config.max_num_blocks // chunk_blocks
        self.storage = PagedKVStorage(config, chunk_blocks, self.max_chunks)
        self.allocator = BlockAllocator(0, config.block_size, enable_prefix_caching=enable_prefix_caching)
        self.num_defragmentations = 0  # compactions that moved at least one block
        self.num_blocks_moved = 0  # blocks those compactions copied
        self.num_chunks_released = 0
        self.peak_allocated_bytes = 0  # the most device memory the pool has held
        self.num_growth_failures = 0  # growths the device refused (out of memory)
        self._no_growth_until = 0.0  # time.monotonic() before which grow() does not try again
        self.device_headroom_bytes = device_headroom_bytes
        self.grow(initial_chunks)

    # ------------------------------------------------------------ sequences
    def allocate(self, seq_id, token_ids: list[int], max_cached_tokens: int | None = None,
                 cache_salt: str | None = None) -> Allocation | NoRoom:
        """Blocks for a new sequence's tokens; `num_cached_tokens` of them are already stored (only
        blocks cached under the same cache_salt are found)."""
        if self.keep_prefixes:
            self._grow_before_evicting(cdiv(len(token_ids), self.config.block_size))
        root = salt_root(cache_salt)
        result = self.allocator.allocate(seq_id, token_ids, max_cached_tokens, root)
        if isinstance(result, NoRoom) and self._grow_for(result):
            result = self.allocator.allocate(seq_id, token_ids, max_cached_tokens, root)
        return result

    def append(self, seq_id, token_ids: list[int]) -> Allocation | NoRoom:
        """Slots for tokens after the sequence's end; copy-on-write runs before this returns."""
        # A decode token mostly lands in its own partial block: count blocks only when the empty
        # ones might not cover the most it can take (its blocks, plus a copy-on-write one).
        if self.keep_prefixes and self._empty_blocks < cdiv(len(token_ids), self.config.block_size) + 1:
            self._grow_before_evicting(self.allocator.blocks_needed_to_append(seq_id, len(token_ids)))
        result = self.allocator.append(seq_id, token_ids)
        if isinstance(result, NoRoom) and self._grow_for(result):
            result = self.allocator.append(seq_id, token_ids)
        if result:
            cache_ops.copy_blocks(self.storage, result.copies)
        return result

    def mark_computed(self, seq_id, num_tokens: int) -> None:
        """K/V of the sequence's first `num_tokens` tokens are written: their full blocks may now
        serve other prompts with the same prefix."""
        self.allocator.commit(seq_id, num_tokens)

    def replace_token(self, seq_id, position: int, token: int) -> None:
        """A placeholder in the sequence's last block becomes the real token (async scheduling:
        call it before mark_computed covers that block). Bookkeeping only: the K/V written at the
        position came from the real token, which the device already had."""
        self.allocator.replace_token(seq_id, position, token)

    def fork(self, parent_id, child_id) -> None:
        self.allocator.fork(parent_id, child_id)

    def free(self, seq_id) -> None:
        self.allocator.free(seq_id)
        if self.keep_prefixes:
            self._busy_at = time.monotonic()  # an idle spell starts at the last sequence's end at the latest

    def write(self, keys: torch.Tensor, values: torch.Tensor, slots, layer_start: int = 0) -> None:
        """Store keys/values [layers, tokens, kv_heads, head_dim] at their slots (-1 = skip)."""
        cache_ops.write_slots(self.storage, keys, values, self._slot_tensor(slots), layer_start)

    def read(self, seq_id) -> torch.Tensor:
        """A copy of a sequence's K/V, [num_layers, 2, tokens, kv_heads, head_dim] (tests, debugging)."""
        return self.storage.read_tokens(self.allocator.block_table(seq_id), self.allocator.seq_len(seq_id))

    def block_table(self, seq_id, num_tokens: int | None = None) -> list[int]:
        """The sequence's blocks in order; with num_tokens, only those its first num_tokens use."""
        return self.allocator.block_table(seq_id, num_tokens)

    def slots(self, seq_id, start: int, stop: int) -> list[int]:
        """Cache slots of the sequence's positions start .. stop - 1."""
        return self.allocator.slots(seq_id, start, stop)

    def seq_len(self, seq_id) -> int:
        return self.allocator.seq_len(seq_id)

    def has_seq(self, seq_id) -> bool:
        return self.allocator.has_seq(seq_id)

    def block_hashes(self, seq_id, start: int, stop: int) -> list[int | None]:
        """Prefix-cache hashes of the sequence's blocks start .. stop - 1: equal at index i, two
        sequences hold the same tokens up to that block's end (None: not full, or no prefix caching)."""
        blocks = self.allocator.blocks
        return [blocks[b].hash for b in self.allocator.block_table(seq_id)[start:stop]]

    # ------------------------------------------------------------------ pool
    @property
    def num_chunks(self) -> int:
        return len(self.storage.chunks)

    @property
    def chunk_blocks(self) -> int:
        """Blocks per chunk: the pool grows and shrinks by this many."""
        return self.storage.chunk_blocks

    @property
    def max_blocks(self) -> int:
        """The most blocks the memory budget allows."""
        return self.max_chunks * self.chunk_blocks

    @property
    def growable_blocks(self) -> int:
        """Blocks the pool may still grow by within its memory budget."""
        return (self.max_chunks - self.num_chunks) * self.chunk_blocks

    @property
    def available_blocks(self) -> int:
        """Blocks a request could get now: free, evictable, and what the budget still lets us grow."""
        return self.allocator.num_free + self.growable_blocks

    @property
    def ptr_table_version(self) -> int:
        """Changes whenever the chunk pointer table moves (captured CUDA graphs read it in place)."""
        return self.storage.ptr_table_version

    @property
    def fragmentation(self) -> float:
        return self.allocator.fragmentation

    def grow(self, num_chunks: int = 1) -> int:
        """Add up to `num_chunks` chunks within the memory budget; returns how many were added.

        The budget is a ceiling, not a promise: another tenant of the device (a second replica,
        another process) may hold the memory by now. A failed allocation adds what fit and is
        "no room" to the caller (the scheduler queues or preempts), never an error; growth is not
        tried again for GROW_RETRY_S, since each failure makes torch empty its cache and retry."""
        count = max(0, min(num_chunks, self.max_chunks - self.num_chunks))
        if not count or time.monotonic() < self._no_growth_until:
            return 0
        before = self.num_chunks
        short = self._device_short_by(count * self.storage.chunk_allocation_bytes)
        if short > 0:  # growing would eat the memory the model's steps need: refuse it now
            self._growth_failed(f"{format_bytes(short)} short of keeping device_headroom_bytes="
                                f"{format_bytes(self.device_headroom_bytes)} free for the model's steps")
            return 0
        try:
            self.storage.add_chunks(count)
        except torch.OutOfMemoryError as exc:
            self._growth_failed(str(exc).splitlines()[0][:200])
        added = self.num_chunks - before
        if added:
            self.allocator.grow(added * self.chunk_blocks)
            self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.storage.allocated_bytes)
        return added

    def _device_short_by(self, nbytes: int) -> int:
        """How far the device is from giving `nbytes` and still keeping device_headroom_bytes
        free (torch's cached but unused memory counts as free); 0 or less when it can."""
        if not self.device_headroom_bytes or self.storage.device.type != "cuda":
            return 0
        device = self.storage.device
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return nbytes + self.device_headroom_bytes - free - cached

    def _growth_failed(self, why: str) -> None:
        self.num_growth_failures += 1
        self._no_growth_until = time.monotonic() + self.GROW_RETRY_S
        if self.num_growth_failures > 1:  # logged once with numbers; the count is in the stats
            logger.debug("KV pool growth failed again (%d times): %s", self.num_growth_failures, why)
            return
        free = total = None
        if self.storage.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.storage.device)
        logger.warning(
            "KV pool could not grow past %d of %d chunks (%s each, %s held): the device is out of memory "
            "(free %s of %s), another tenant likely holds what the budget assumed. Requests queue or are "
            "preempted instead; growth is retried every %.0f s. Lower kv_cache_memory or "
            "gpu_memory_utilization to stop this. (%s)",
            self.num_chunks, self.max_chunks, format_bytes(self.storage.chunk_bytes),
            format_bytes(self.storage.allocated_bytes), "?" if free is None else format_bytes(free),
            "?" if total is None else format_bytes(total), self.GROW_RETRY_S, why)

    def defragment(self) -> DefragResult:
        """Move every block holding data into the lowest ids (fewest moves, one launch)."""
        moves = self.allocator.plan_compaction()
        cache_ops.copy_blocks(self.storage, list(moves.items()))
        self.num_defragmentations += bool(moves)
        self.num_blocks_moved += len(moves)
        return DefragResult(blocks_moved=len(moves), bytes_moved=len(moves) * self.config.block_bytes)

    def shrink(self, keep_free_blocks: int = 0, min_chunks: int = 1) -> int:
        """Give tail chunks back to the device; returns how many chunks were released.

        Keeps every block live sequences hold, at least `keep_free_blocks` more and `min_chunks`
        chunks. Cached prefix blocks that no longer fit are evicted, least recently used first;
        the rest are compacted below the cut together with the live ones.
        """
        chunk_blocks = self.chunk_blocks
        release = self.spare_chunks(keep_free_blocks, min_chunks)
        if release <= 0:
            return 0
        capacity = (self.num_chunks - release) * chunk_blocks
        holding_data = self.allocator.num_used + self.allocator.num_evictable
        self.allocator.evict(holding_data - capacity)
        if self.allocator.high_water_mark > capacity:
            self.defragment()
        self.allocator.shrink(release * chunk_blocks)
        self.storage.release_chunks(release)
        self.num_chunks_released += release
        return release

    def spare_chunks(self, keep_free_blocks: int = 0, min_chunks: int = 1) -> int:
        """Tail chunks shrink() would release now."""
        needed = max(min_chunks, cdiv(self.allocator.num_used + keep_free_blocks, self.chunk_blocks))
        return max(0, self.num_chunks - needed)

    @property
    def _headroom_blocks(self) -> int:
        """Free blocks maintain() keeps when it releases chunks."""
        return self.KEEP_FREE_CHUNKS * self.chunk_blocks

    def _kept_blocks(self, now: float) -> int:
        """Blocks maintain() keeps besides live ones and headroom: with keep_prefixes, the cached
        prefixes, until the pool has had no live sequence for release_after_s."""
        if self.keep_prefixes and (self.allocator.num_used or now - self._busy_at < self.release_after_s):
            return self.allocator.num_evictable
        return 0

    def seconds_until_release(self, now: float | None = None) -> float | None:
        """How long until maintain() would give spare chunks back (the count starts now if it had
        not started); None when no chunk is spare. With keep_prefixes an idle pool's cached
        prefixes are spare once it has been idle for release_after_s: the time until then."""
        now = time.monotonic() if now is None else now
        kept = self._kept_blocks(now)
        if not self.spare_chunks(self._headroom_blocks + kept):
            if kept and not self.allocator.num_used and self.spare_chunks(self._headroom_blocks):
                return self._busy_at + self.release_after_s - now  # idle: the cached prefixes' turn comes then
            return None
        if self._spare_since is None:
            self._spare_since = now
        if self.keep_prefixes and not self.allocator.num_used:  # idle since _busy_at: all of it spare since
            self._spare_since = min(self._spare_since, self._busy_at)
        return max(0.0, self._spare_since + self.release_after_s - now)

    def maintain(self, reserve_blocks: int | None = None, now: float | None = None) -> MaintenanceReport:
        """The automatic policy, run between steps: grow when free blocks run low, compact past
        the fragmentation threshold (like llama.cpp's defrag_thold), release idle tail chunks.

        reserve_blocks: free blocks wanted before the next maintenance (the engine passes what its
        running requests can take by then); None: GROW_WHEN_FREE_BELOW of the pool. Growing
        ahead of need only saves an allocation inside a step (allocate/append grow on demand),
        so a tight reserve keeps the pool's peak close to what live tokens need. Spare chunks go
        back only after `release_after_s` of being spare at every call (now: time.monotonic())."""
        added = 0
        a = self.allocator
        now = time.monotonic() if now is None else now
        if a.num_used:
            self._busy_at = now
        low = self.GROW_WHEN_FREE_BELOW * a.num_blocks if reserve_blocks is None else reserve_blocks
        if (self._empty_blocks if self.keep_prefixes else a.num_free) < low:
            added = self.grow(1)
        defrag = None
        if self.fragmentation >= self.config.defrag_threshold and self.fragmentation > 0:
            defrag = self.defragment()
        released = 0
        wait = None if added else self.seconds_until_release(now)
        if wait == 0:
            released = self.shrink(keep_free_blocks=self._headroom_blocks + self._kept_blocks(now))
        if wait is None or released:
            self._spare_since = None  # nothing spare (or no longer): the next spare spell counts from 0
        return MaintenanceReport(chunks_added=added, defrag=defrag, chunks_released=released)

    def record_prefix_events(self, log) -> None:
        """Record into `log` (a PrefixEventLog) every prefix block stored and dropped from now on."""
        self.allocator.prefix_events = log

    def stats(self) -> CacheStats:
        a = self.allocator
        return CacheStats(
            total_blocks=a.num_blocks, max_blocks=self.max_blocks,
            free_blocks=a.num_free, used_blocks=a.num_used, evictable_blocks=a.num_evictable,
            num_seqs=len(a.seq_ids()), high_water_mark=a.high_water_mark,
            fragmentation=a.fragmentation, allocated_bytes=self.storage.allocated_bytes)

    def invariants(self) -> list[str]:
        problems = self.allocator.invariants()
        if self.allocator.num_blocks != self.storage.num_blocks:
            problems.append(f"allocator has {self.allocator.num_blocks} blocks, storage {self.storage.num_blocks}")
        return problems

    # --------------------------------------------------------------- helpers
    def _grow_for(self, no_room: NoRoom) -> bool:
        """Grow enough for a refused request if the budget allows it; True if it grew."""
        missing = no_room.needed - no_room.free
        chunks = cdiv(missing, self.chunk_blocks)
        if self.num_chunks + chunks > self.max_chunks:
            return False
        return self.grow(chunks) == chunks

    @property
    def _empty_blocks(self) -> int:
        """Free blocks that hold no cached prefix."""
        return self.allocator.num_free - self.allocator.num_evictable

    def _grow_before_evicting(self, needed: int) -> None:
        """keep_prefixes: blocks for `needed` new ones from the budget, not from cached prefixes."""
        empty = self._empty_blocks
        if self.allocator.num_evictable and empty < needed:
            self.grow(cdiv(needed - empty, self.chunk_blocks))

    def _slot_tensor(self, slots) -> torch.Tensor:
        slots = (slots if isinstance(slots, torch.Tensor) else torch.tensor(slots)).to(dtype=torch.int64)
        if slots.device == self.storage.device:
            return slots
        return to_device(slots, self.storage.device)  # pinned and queued: no wait for the steps in flight

    def __repr__(self) -> str:
        c, s = self.config, self.stats()
        return (f"PagedKVCache(layers={c.num_layers}, kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, "
                f"dtype={c.dtype}, block_size={c.block_size}, blocks={s.used_blocks} used / "
                f"{s.total_blocks} held / {s.max_blocks} max, device={c.device})")
