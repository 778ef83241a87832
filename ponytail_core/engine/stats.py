"""What the engine reports: `EngineStats`, and the running count of blocks its requests are promised.

Serving reads these instead of the pool and the scheduler (vLLM's callers see
`KVCacheManager.usage`, never the block pool): a replica admits a request where
`admissible_blocks - promised_blocks` covers it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..utils.arith import cdiv
from .request import Request


@dataclass(frozen=True, slots=True)
class EngineStats:
    total_blocks: int  # blocks the pool holds now
    max_blocks: int  # the most blocks the pool may hold (its memory budget)
    free_blocks: int  # allocatable now, evictable prefix blocks included
    admissible_blocks: int  # free_blocks plus what the pool may still grow by
    promised_blocks: int  # blocks queued and running requests will still take to reach prompt + max_tokens
    queued_blocks: int  # blocks the waiting requests' tokens take when admitted (prefix hits not looked up)
    headroom_blocks: int  # free blocks admission leaves running requests to decode into (the watermark)
    used_blocks: int  # held by live requests
    cached_blocks: int  # cached prefix blocks nobody holds (evictable, counted in free_blocks)
    num_running: int
    num_waiting: int
    fragmentation: float
    num_preemptions: int
    num_defragmentations: int  # pool compactions that moved blocks
    num_blocks_moved: int  # blocks those compactions copied
    prefix_cache_queries: int  # prompt tokens admitted
    prefix_cache_hits: int  # of those, served from cached blocks
    allocated_bytes: int

    @property
    def startable_blocks(self) -> int:
        """Blocks a new request's prompt may take now, behind the waiting queue: the engine admits
        a prompt when it fits these (running requests' later growth is not counted; when the pool
        runs short the engine preempts the newest, as vLLM does)."""
        return self.admissible_blocks - self.queued_blocks - self.headroom_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class BlockPromises:
    """Blocks queued and running requests will still take to reach prompt + max_tokens.

    A waiting request (new or preempted) is promised every block of prompt + max_tokens; a running
    one those its tokens so far do not fill yet. A parent of n > 1 samples is also promised, until
    it forks them, what each other sample will take: its sequence's blocks but the prompt's full
    ones, which the samples share (a partial last block is copied on write). The engine's thread
    keeps the total as requests arrive, start, grow into a new block, are preempted and leave, so a
    report from another thread reads one int instead of walking the scheduler's lists while they
    change. `queued` counts, the same way, the blocks waiting requests' tokens take when admitted.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.total = 0
        self.queued_total = 0  # blocks the waiting requests' tokens so far take at admission
        self._waiting: dict[str, int] = {}  # waiting request -> its share of queued_total
        self._held: dict[str, int] = {}  # running request -> blocks its tokens fill, as counted
        self._to_fork: dict[str, int] = {}  # parent not forked yet -> blocks its other samples will take

    def need(self, request: Request) -> int:
        """Blocks of the request's prompt + max_tokens."""
        return cdiv(len(request.prompt_token_ids) + request.params.max_tokens, self.block_size)

    def queued(self, request: Request) -> None:
        """A request joins the waiting queue (new)."""
        self.total += self.need(request)
        self._wait(request)
        others = request.seqs_to_come - 1
        if others > 0:
            shared = len(request.prompt_token_ids) // self.block_size
            self._to_fork[request.request_id] = others * (self.need(request) - shared)
            self.total += self._to_fork[request.request_id]

    def forked(self, parent: Request) -> None:
        """A parent forked its other samples: each is promised its own blocks from now on (adopted)."""
        self.total -= self._to_fork.pop(parent.request_id, 0)

    def started(self, request: Request) -> None:
        """A waiting request runs: the blocks its tokens fill are no longer promised."""
        self.queued_total -= self._waiting.pop(request.request_id, 0)
        held = min(cdiv(request.num_tokens, self.block_size), self.need(request))
        self._held[request.request_id] = held
        self.total -= held

    def grew(self, request: Request) -> None:
        """A running request got a token (the engine's hot path: one division, one lookup)."""
        held = cdiv(request.num_tokens, self.block_size)
        counted = self._held[request.request_id]
        if held > counted:
            held = min(held, self.need(request))
            self.total -= held - counted
            self._held[request.request_id] = held

    def preempted(self, request: Request) -> None:
        """A running request goes back to the queue: it is promised all its blocks again."""
        self.total += self._held.pop(request.request_id)
        self._wait(request)

    def left(self, request: Request, running: bool) -> None:
        """A request leaves the scheduler (finished or aborted), from the running list or the queue."""
        held = self._held.pop(request.request_id) if running else 0
        self.queued_total -= self._waiting.pop(request.request_id, 0)
        self.total -= self.need(request) - held + self._to_fork.pop(request.request_id, 0)

    def _wait(self, request: Request) -> None:
        blocks = cdiv(request.num_tokens, self.block_size)
        self._waiting[request.request_id] = blocks
        self.queued_total += blocks
