"""PrefixAffinityRouter: KVBlockRouter that also weighs the prompt tokens a replica has cached."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

import ponytail

from deployments.api.prompts import (prompt_token_ids, tokenizer_fingerprint, truncated, use_chat_template,
                                     with_template_defaults)
from deployments.api.protocol import GenerateRequest
from deployments.api.segment_tokens import SegmentCache

from .prefix_index import PrefixIndex
from .routing_stats import STAT_CACHED_BLOCKS
from .router import KVBlockRouter, Placement, Report, blocks_needed, read_report, request_tokens

logger = logging.getLogger(__name__)


class PrefixAffinityRouter(KVBlockRouter):
    """KVBlockRouter's tiers, hold queue and block reservations, plus prefix-cache affinity.

    Each replica publishes the hashes of the prefix blocks it stores and drops (prefix_publisher.py);
    this router keeps them per replica (prefix_index.py) with the prompts it sent there itself. A
    request's prompt is hashed the way the engine's block allocator chains it
    (ponytail.prefix_block_hashes, capped at len(prompt) - 1 tokens as the engine admits it), so
    `hits`, its leading blocks found in a replica's index, is the engine's prefix hit there. Then:

    - need = blocks of (prompt + what the admission counts of the output: KVBlockRouter) - hits:
      cached blocks are not taken again, so a replica that holds the prefix fits requests the
      free-block count alone would call too big, and the reservation is need;
    - evicts = need beyond the replica's free blocks that hold no cached prefix (cached_blocks):
      those blocks push other prefixes out of its cache; each is weighed by the index's reuse
      share (held blocks that a routed request has hit), what an evicted block is likely worth;
    - affinity = PREFIX_WEIGHT * (hits - evicts * reuse share) / blocks of (prompt + max_tokens),
      taken off the score (pool share in use + load share, lower first). A request that would
      evict more reused prefix than it gains has negative affinity and goes elsewhere unless every
      replica evicts as much. A cache of one-off prompts (a random mix) costs nothing to evict, so
      such traffic ranks as under KVBlockRouter; weighing every eviction alike would steer it to
      whichever replica has served less so far instead of the less loaded one.

    The score's other two terms each run from 0 to 1, so at PREFIX_WEIGHT 2 a request whose
    blocks are nearly all cached on one replica goes there unless that replica is both the fullest
    and the busiest; a shared system prompt cached everywhere weighs the same on each replica and
    load decides. Stale reports still count as KVBlockRouter says (tier 2, by queue length), the
    index breaking ties of equal queues: it is a hint, and a wrong one costs a recomputed prefix,
    never a failed request.

    Prompts sent as token ids are hashed as they are. Chat messages and text are tokenized here
    with the engine's tokenizer, once per request (loaded when Ray builds the router, `model` kwarg:
    None for the default model; where it cannot be loaded they route on blocks and load alone), and
    the ids travel with the request (GenerateRequest.tokenized): a replica with the same tokenizer
    does not tokenize again, which cost each request ~20 ms more than the free-block router under load.
    Long ones (THREAD_TOKENS and up, by the request's own guess) in a worker thread, as the replica
    does: this event loop routes every request of the process, and a 4 MB prompt takes seconds.

        RequestRouterConfig(request_router_class="deployments.prefix_router:PrefixAffinityRouter",
                            request_router_kwargs={"prefix_weight": 2.0, "model": None})
    """

    PREFIX_WEIGHT = 2.0
    """How much a fully cached request is worth, in units of the score's pool-share and load terms."""

    THREAD_TOKENS = 1024
    """Prompts guessed at this many tokens or more are tokenized in a worker thread (the fast
    tokenizer releases the GIL); shorter ones take less than the hand-over."""

    _HASHES = "ponytail_prompt_hashes"  # attribute on a request's routing_context: (block_size, hashes, tokens)
    _IDS = "ponytail_prompt_ids"  # attribute on a request's routing_context: (token ids or None,)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefix_weight = self.PREFIX_WEIGHT
        self.tokenizer: Any = None
        self._tokenizer_model: str | None = None
        self._tokenizer_options: dict = {}
        self._fingerprint: str | None = None  # the tokenizer's (prompts.tokenizer_fingerprint)
        self.segments: SegmentCache | None = None
        self.template_defaults: dict | None = None  # the app's default_chat_template_kwargs
        self._indexes: dict[ReplicaID, PrefixIndex] = {}

    def initialize_state(self, prefix_weight: float | None = None, model: str | None = None,
                         tokenize: bool = True, tokenizer: Any = None, chat_template: str | None = None,
                         default_chat_template_kwargs: dict | None = None, revision: str | None = None,
                         trust_remote_code: bool = False, **rest):
        """Takes KVBlockRouter's request_router_kwargs and prefix_weight (>= 0; 0 ranks like
        KVBlockRouter with cached blocks not counted twice), model (whose tokenizer to load),
        tokenize (False: hash token-id prompts only), tokenizer (tests: one already loaded),
        chat_template (the app's, which the replicas serve instead of the tokenizer's),
        default_chat_template_kwargs (the app's, which the replicas render chats with), and revision and
        trust_remote_code (the app's: the tokenizer the engine loaded)."""
        super().initialize_state(**rest)
        if prefix_weight is not None:
            number = isinstance(prefix_weight, (int, float)) and not isinstance(prefix_weight, bool)
            if not (number and math.isfinite(prefix_weight) and prefix_weight >= 0):
                raise ValueError(f"request_router_kwargs prefix_weight={prefix_weight!r}; expected a number >= 0")
            self.prefix_weight = float(prefix_weight)
        if not isinstance(tokenize, bool):
            raise ValueError(f"request_router_kwargs tokenize={tokenize!r}; expected true or false")
        self._tokenizer_model, self.tokenizer = model, tokenizer
        self._tokenizer_options = {"revision": revision, "trust_remote_code": trust_remote_code}  # the engine's
        if tokenize and tokenizer is None:
            # Here, once: Ray builds the router at a handle's first call, which waits the second or
            # two this takes; every chat or text prompt after it is hashed as the engine will run it.
            self._load_tokenizer()
        if self.tokenizer is not None:
            use_chat_template(self.tokenizer, chat_template)
            self.template_defaults = default_chat_template_kwargs
            self._fingerprint = tokenizer_fingerprint(self.tokenizer, default_chat_template_kwargs)
            self.segments = SegmentCache(self.tokenizer)  # a session's earlier turns are not tokenized again

    # ------------------------------------------------------------------ the prompt
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """KVBlockRouter's ranking, a long prompt tokenized first off this event loop."""
        request = _generate_request(pending_request)
        context = pending_request.routing_context if request is not None else None
        if request is not None and self._long(request) and getattr(context, self._IDS, None) is None:
            setattr(context, self._IDS, (await asyncio.to_thread(self._token_ids, request),))
        return await super().choose_replicas(candidate_replicas, pending_request)

    def _long(self, request: GenerateRequest) -> bool:
        """Text or messages this router tokenizes in a worker thread."""
        if self.tokenizer is None or (isinstance(request.prompt, list) and request.messages is None):
            return False
        try:
            return request.num_prompt_tokens_hint() >= self.THREAD_TOKENS
        except (AttributeError, TypeError):  # malformed messages: routed on size alone, the replica says why
            return False

    def prompt_hashes(self, pending_request: PendingRequest | None, block_size: int) -> tuple[list[int], int] | None:
        """(the prompt's block hashes as the engine chains them, its exact tokens + max_tokens);
        None when the prompt's token ids are not known (not a generate call, tokenizer not loaded)."""
        if pending_request is None:
            return None
        context = pending_request.routing_context
        cached = getattr(context, self._HASHES, None)
        if cached is not None and cached[0] == block_size:
            return cached[1], cached[2]
        request = _generate_request(pending_request)
        if request is None:
            return None
        known = getattr(context, self._IDS, None)
        ids = known[0] if known is not None else self._token_ids(request)
        tokens = request_tokens(pending_request, reserve=self.counts_output)
        if ids is None or tokens is None:
            return None
        tokens += len(ids) - request.num_prompt_tokens_hint()  # the hint's guess replaced by the count
        if self._fingerprint is not None and ids is not request.prompt:
            # Tokenized here: the replica takes these ids rather than tokenize the prompt again
            # (one tokenizing on a request's path, as under the free-block router).
            request.tokenized = (self._fingerprint, ids)
        hashes = ponytail.prefix_block_hashes(ids, block_size, max_cached_tokens=len(ids) - 1,
                                              cache_salt=request.cache_salt)
        setattr(context, self._HASHES, (block_size, hashes, tokens))
        return hashes, tokens

    def _token_ids(self, request: GenerateRequest) -> list[int] | None:
        """The prompt's token ids as the replica will run them (None: not known here)."""
        ids = self._all_token_ids(request)
        keep = request.truncate_prompt_tokens
        if ids is not None and isinstance(keep, int) and keep > 0 and len(ids) > keep:
            ids = truncated(ids, keep, request.truncation_side)  # what the replica runs (-1 depends on its context)
        return ids

    def _all_token_ids(self, request: GenerateRequest) -> list[int] | None:
        if isinstance(request.prompt, list) and request.messages is None:
            return request.prompt
        if self.tokenizer is None:  # none could be loaded here: size and load decide
            return None
        try:
            return prompt_token_ids(self.tokenizer, with_template_defaults(request, self.template_defaults),
                                    self.segments)
        except Exception:  # malformed messages: the replica reports the error; route it on size alone
            return None

    def _load_tokenizer(self) -> None:
        try:
            self.tokenizer = ponytail.load_tokenizer(self._tokenizer_model, **self._tokenizer_options)
        except Exception as exc:  # the app still serves; chat and text prompts lose their affinity only
            logger.warning("prefix router: no tokenizer for model %r (%s); chat and text prompts route without "
                           "prefix affinity", self._tokenizer_model, exc)

    # ------------------------------------------------------------------ the ranking
    def _placement(self, replica: RunningReplica, report: Report, free: int, tokens: int | None,
                   pending_request: PendingRequest | None) -> Placement:
        prompt = self.prompt_hashes(pending_request, report.block_size)
        if prompt is None:
            return super()._placement(replica, report, free, tokens, pending_request)
        hashes, tokens = prompt
        total = blocks_needed(tokens, report.block_size)
        counted = blocks_needed(tokens - self.uncounted_tokens(pending_request), report.block_size)
        index = self.index(replica)
        hits = min(index.match(hashes), counted - 1)
        need = counted - hits
        cached_blocks = _cached_blocks(replica.routing_stats)
        evicts = max(0, need - max(0, free - cached_blocks))
        lost = evicts * index.reuse_share
        return Placement(need=need, affinity=self.prefix_weight * (hits - lost) / total)

    def _stale_affinity(self, replica: RunningReplica, report: Report | None,
                        pending_request: PendingRequest | None) -> int:
        """The prompt's leading blocks in the replica's index: with the load reports late (a busy
        control plane), equal queues still go where the prefix is. The index stays a hint."""
        prompt = self.prompt_hashes(pending_request, report.block_size if report is not None else
                                    self.FALLBACK_BLOCK_SIZE)
        return 0 if prompt is None else self.index(replica).match(prompt[0])

    def _reserved_blocks(self, pending_request: PendingRequest, replica_id: ReplicaID, report: Report | None) -> int:
        replica = self._replicas.get(replica_id)
        prompt = self.prompt_hashes(pending_request, report.block_size) if report is not None else None
        if prompt is None or replica is None:
            return super()._reserved_blocks(pending_request, replica_id, report)
        hashes, tokens = prompt
        index = self.index(replica)
        counted = blocks_needed(tokens - self.uncounted_tokens(pending_request), report.block_size)
        hits = min(index.match(hashes), counted - 1)
        index.mark_reused(hashes[:hits])
        index.add(hashes)  # there once prefilled: the next request with this prefix sees it at once
        return counted - hits

    def index(self, replica: RunningReplica) -> PrefixIndex:
        """The replica's prefix index, with the events of its latest report applied."""
        index = self._indexes.get(replica.replica_id)
        if index is None:
            index = self._indexes[replica.replica_id] = PrefixIndex()
        stats = replica.routing_stats
        if stats:
            report = read_report(stats)
            index.apply_report(stats, report.total_blocks if report is not None else 0)
        return index

    # ------------------------------------------------------------------ replicas
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray calls this with every new report too: apply its events even when nothing routes."""
        super().update_replicas(replicas)
        for replica in replicas:
            self.index(replica)
        for replica_id in [rid for rid in self._indexes if rid not in self._replicas]:
            del self._indexes[replica_id]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._indexes.pop(replica_id, None)


def _generate_request(pending_request: PendingRequest | None) -> GenerateRequest | None:
    args = pending_request.args if pending_request is not None else None
    return args[0] if args and isinstance(args[0], GenerateRequest) else None


def _cached_blocks(stats: Any) -> int:
    try:
        return max(0, int(stats.get(STAT_CACHED_BLOCKS, 0)))
    except (AttributeError, TypeError, ValueError):
        return 0
