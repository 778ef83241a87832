"""KVBlockRouter: sends each generate request to a lightly loaded engine replica with room for its KV blocks.

Ray Serve builds one router in every process that holds a handle to the engine deployment (the
ingress replicas, other Ray apps) from the engine's `request_router_config`; KVBlockRouter's
docstring shows the config to use.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ponytail import DEFAULT_BLOCK_SIZE, SamplingParams, is_seconds

from .protocol import (ADMISSIONS, STAT_BLOCK_SIZE, STAT_FREE_BLOCKS, STAT_NUM_RUNNING, STAT_NUM_WAITING,
                       STAT_STARTABLE_BLOCKS, STAT_TIME, STAT_TOTAL_BLOCKS, GenerateRequest)

DEFAULT_MAX_TOKENS = SamplingParams().max_tokens  # used when the request leaves it out, as the replica does


@dataclass(slots=True, frozen=True)
class Report:
    """The part of one replica's record_routing_stats() dict the ranking reads."""

    free_blocks: int  # free once the requests there reach max_tokens, plus what the pool may still grow by
    startable_blocks: int  # what the engine admits a new prompt into now (free_blocks when not reported)
    total_blocks: int  # the most blocks the pool may hold (0: not reported)
    load: int  # num_running + num_waiting
    block_size: int  # tokens per block
    time: float  # time.time() on the replica when it read its stats


def read_report(stats: Any) -> Report | None:
    """A replica's routing stats as a Report; None when it has not reported yet or the dict is malformed."""
    if not stats:
        return None
    try:
        free = int(stats[STAT_FREE_BLOCKS])
        report = Report(free_blocks=free, startable_blocks=int(stats.get(STAT_STARTABLE_BLOCKS, free)),
                        total_blocks=int(stats.get(STAT_TOTAL_BLOCKS, 0)),
                        load=int(stats[STAT_NUM_RUNNING]) + int(stats[STAT_NUM_WAITING]),
                        block_size=int(stats[STAT_BLOCK_SIZE]), time=float(stats[STAT_TIME]))
    except (KeyError, TypeError, ValueError):
        return None
    return report if report.block_size >= 1 and math.isfinite(report.time) else None


def request_tokens(pending_request: PendingRequest | None, output: bool = True, reserve: bool = False) -> int | None:
    """Prompt tokens (a cheap upper-bound guess) plus output_tokens(); None when arg 0 is not a
    GenerateRequest or its messages are malformed (the replica reports the error)."""
    sampled = output_tokens(pending_request, output, reserve)
    if sampled is None:
        return None
    try:
        return pending_request.args[0].num_prompt_tokens_hint() + sampled
    except (AttributeError, TypeError):
        return None


def output_tokens(pending_request: PendingRequest | None, output: bool = True, reserve: bool = False) -> int | None:
    """max_tokens for each sample (n, or best_of when larger: they share the prompt), or with
    output=False each sample's first token only; None when arg 0 is not a GenerateRequest or its
    sampling is malformed (the replica reports the error). Reads no prompt.

    A request without max_tokens runs to the end of the context (max_tokens_to_context): how much
    it will write is not known, so it counts its first token only, unless `reserve` (admission
    "max_tokens", which never under-counts): then the bound its sampling carries (the context, or
    the operator's max_output_tokens). Counted as that bound, an affinity or a completion's freed
    blocks would be a whole context's worth for a chat that writes a paragraph."""
    args = pending_request.args if pending_request is not None else None
    if not args or not isinstance(args[0], GenerateRequest):
        return None
    if args[0].max_tokens_to_context and not reserve:
        output = False
    sampling = args[0].sampling
    try:
        max_tokens = sampling.get("max_tokens", DEFAULT_MAX_TOKENS)
        samples = max(_count(sampling.get("n")), _count(sampling.get("best_of")))
    except (AttributeError, TypeError):
        return None
    if not isinstance(max_tokens, int) or max_tokens < 1:
        max_tokens = DEFAULT_MAX_TOKENS  # the replica rejects the request; size it like a default one
    return samples * (max_tokens if output else 1)


def _count(value: Any) -> int:
    """n or best_of as sent; 1 when unset or invalid (the replica rejects an invalid one)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


def blocks_needed(tokens: int | None, block_size: int) -> int:
    """ceil(tokens / block_size); none for a call that is not a generate request (report,
    model_info, abort): it fits every replica and is never held."""
    return 0 if tokens is None else max(1, -(-tokens // block_size))


@dataclass(slots=True)
class Ledger:
    """What this router knows of one replica that its latest report cannot show yet.

    Sends routed after the report was taken still need their blocks there; requests that
    completed after it have given theirs back. A newer report counts both, so it drops them.
    """

    report_time: float = -math.inf  # `time` of the newest report seen
    sends: deque[tuple[float, int]] = field(default_factory=deque)  # (router clock when routed, blocks), oldest first
    sent_blocks: int = 0  # sum of the blocks in `sends`
    returns: deque[tuple[float, int]] = field(default_factory=deque)  # (router clock when completed, blocks)
    returned_blocks: int = 0  # sum of the blocks in `returns`
    in_flight: dict[str, list[int]] = field(default_factory=dict)  # internal_request_id -> blocks of each call
    num_in_flight: int = 0  # calls routed and not completed

    @property
    def unreported_blocks(self) -> int:
        """Blocks to take off the report's free count (negative: blocks to add)."""
        return self.sent_blocks - self.returned_blocks

    def observe(self, report: Report) -> None:
        """A newer report already counts what was sent and returned before it was taken."""
        if report.time > self.report_time:
            self.report_time = report.time
            self.forget(report.time)

    def forget(self, until: float) -> None:
        """Drops the sends and returns recorded at or before `until`."""
        while self.sends and self.sends[0][0] <= until:
            self.sent_blocks -= self.sends.popleft()[1]
        while self.returns and self.returns[0][0] <= until:
            self.returned_blocks -= self.returns.popleft()[1]

    def reserve(self, now: float, blocks: int) -> tuple[float, int]:
        """Blocks taken off the report from now on (a request chosen for the replica); the entry."""
        entry = (now, blocks)
        self.sends.append(entry)
        self.sent_blocks += blocks
        return entry

    def unreserve(self, entry: tuple[float, int]) -> None:
        """Undoes reserve() unless a newer report already dropped the entry."""
        try:
            self.sends.remove(entry)
        except ValueError:
            return
        self.sent_blocks -= entry[1]

    def start(self, request_id: str, entry: tuple[float, int], grown: int = 0) -> None:
        """The replica accepted the request: it is in flight until completed, when it gives back
        its reserved blocks and the `grown` ones its output came to hold beyond them."""
        self.in_flight.setdefault(request_id, []).append(entry[1] + grown)
        self.num_in_flight += 1

    def complete(self, now: float, request_id: str) -> None:
        calls = self.in_flight.get(request_id)
        if not calls:  # rejected by the replica, so never routed: Ray still reports it completed
            return
        blocks = calls.pop(0)
        if not calls:
            del self.in_flight[request_id]
        self.num_in_flight -= 1
        self.returns.append((now, blocks))
        self.returned_blocks += blocks


@dataclass(slots=True, frozen=True)
class Placement:
    """What a request would cost on one replica, for the ranking."""

    need: int  # blocks it takes there; the replica fits it when its effective free blocks cover this
    affinity: float = 0.0  # taken off the replica's score (lower ranks first): what it saves there


@dataclass(slots=True, frozen=True)
class Reservation:
    """Blocks reserved on a replica when it was chosen for a request, before the replica accepted it."""

    pending: PendingRequest
    replica_id: ReplicaID
    entry: tuple[float, int]  # the ledger's (time, blocks) send entry
    grown: int = 0  # blocks its output may add beyond entry's, given back with them on completion


@dataclass(slots=True, frozen=True)
class HeldRequest:
    """A request this process's router held for want of room, once a replica was chosen for it."""

    replica: str  # the replica's unique id
    blocks: int  # what it reserved there
    seconds: float  # from its first hold to that choice


HOLDS: deque[HeldRequest] = deque(maxlen=100_000)
"""The held requests of every router in this process, oldest first (the ingress hands them out:
OpenAIIngress.take_router_holds, read by benchmarks/bench_router.py). Reach it through hold_log()."""


def hold_log() -> deque[HeldRequest]:
    """HOLDS of the imported module. Serve ships a router class by value (cloudpickle), and its
    methods then read copies of this module's globals: a deque appended there is not the one the
    ingress, importing this module, would read."""
    return importlib.import_module(__name__).HOLDS


@dataclass(slots=True)
class Claim:
    """The blocks a held request waits for on one replica (the oldest claim counts: class docstring)."""

    pending: PendingRequest
    replica_id: ReplicaID
    blocks: int  # the held request's need there
    arrival: tuple[float, int]  # (created_at, id): claims of requests that arrived first take precedence
    renewed: float  # router clock of the last poll that held the request


class KVBlockRouter(FIFOMixin, RequestRouter):
    """Ranks engine replicas by the KV-cache blocks they have free for this request.

    Every `request_routing_stats_period_s` each replica reports (record_routing_stats) its free
    blocks, running and waiting requests, block size and the time of the reading. How blocks are
    counted is `admission`:

    - "engine" (the default) counts as the engine admits: a request needs the blocks of its prompt
      and first token (ceil((prompt tokens + samples) / block_size)), against the replica's
      startable blocks (free now behind its waiting queue, less the decode headroom). A request
      starts where it would start had it been queued there; running requests' later growth is the
      engine's to handle (it preempts the newest when the pool runs short, as vLLM does);
    - "max_tokens" reserves: a request needs ceil((prompt tokens + max_tokens) / block_size),
      against the blocks left once every request there reaches max_tokens (TGI's reservation).
      Never a preemption, but requests wait here while blocks sit free: under a backlog of
      short requests the engines run fewer at once than they could.

    The size comes from the request's GenerateRequest (none if the first argument is something
    else: such calls fit everywhere). A replica's effective free blocks are its reported free (or
    startable) blocks minus the blocks this router routed to it after that report was taken, plus
    the blocks of requests that completed since, their output's included, counted to max_tokens
    (the ledger; a newer report drops what it already counts). Replicas are then ranked in three tiers:

    1. fresh report, effective free blocks >= need: lowest score first, where score = the share of
       the pool in use (1 - effective free / total) + the load (running + waiting, plus this
       router's sends since the report, or this router's calls in flight there if more) as a
       share of the largest load among these replicas. Memory decides where a request can go;
       among those, KV in use (which counts a 4k-token prompt as 250 short ones) and request
       count weigh equally, as llm-d's kv-cache-utilization and queue scorers do; ties to most
       free blocks. Not Ray's queue-length cache here: a replica's accept reply sets it to every
       call running there (another handle's, a monitoring `report`), and only this router's
       completions count back down, so it stays high until it expires (10 s) and an idle
       replica with the prefix cached lost to the other one;
    2. no report, or one older than STATS_MAX_AGE_S: fewest queued requests first (Ray's queue
       length cache, or this router's own in-flight count when larger or when the cache is empty),
       ties to _stale_affinity (the prefix router's cached blocks), then at random;
    3. fresh report, too few blocks: smallest deficit first, ties to fewer running+waiting.

    Unknown replicas rank above ones that cannot fit the request because a fresh report proves the
    request would wait or preempt there, while an unreported replica (just started, or its reports
    are late) may well have room; Ray's queue-length check still keeps full replicas out. When
    every report is stale the router degrades to least-queue routing.

    When every replica has a fresh report and none has room, a generate request is held here
    (polling every HOLD_POLL_S) rather than queued in one engine: it goes to whichever replica
    frees blocks first, as one queue in front of all replicas would send it. While held it claims
    the replica closest to fitting it (tier 3's order among pools that can hold it, the replica it
    claimed already on ties). The oldest claim (by created_at) counts, as EASY backfilling
    reserves for the head of its queue: to requests that arrived after it, that replica's
    effective free blocks are less the claim, so they go elsewhere, wait, or backfill only blocks
    it does not need; the next oldest takes over once it is routed. Ray ranks up to two requests
    per replica at once, so without the claim short ones arriving later took each block freed
    under a held 4k-token prompt. (Counting every claim makes the hold strictly first come first
    served, which in a simulated backlog cost mean wait and gained no p99.) A claim ends when its
    request is routed or cancelled, lapses when no poll renews it for CLAIM_TTL_S, and counts only
    while the replica's report is fresh. After max_hold_s (or at once when its blocks exceed every
    replica's whole pool, so the engine refuses it with a clear error) the request goes to tier
    3's first replica. Ray's max_queued_requests still bounds what waits here.

    Each rank holds one replica: Ray picks the shortest queue within a rank, so ranks of one keep
    the block order, and Ray moves on to the next rank when a replica's queue is full
    (max_ongoing_requests). Remaining ties are broken at random so that routers do not all pick the
    same replica. The ledger only knows this router's sends: other routers' show up at the next
    report. choose_replicas reads in-memory state only, awaits nothing but a held request's poll,
    and costs O(n log n) in the number of replicas plus O(held requests) for the claims.

    The chosen replica goes to the request it was ranked for: Ray's routing tasks finish out of
    order (each awaits queue-length probes), and FIFOMixin alone would hand the replica picked
    for a 4k-token prompt to whichever request is oldest, in bursts often a short one.
    _get_pending_request_matching_metadata finds the ranked request by its metadata object (one
    per call); only when it is gone does FIFO order decide. Ray's default matching, by
    internal_request_id, is not used because every engine call made while serving one ingress
    request shares that id: two concurrent calls (n > 1) would leave the second one unrouted.

    The request's blocks go into the ledger the moment its replica is chosen, not when the replica
    accepts it a round trip later (on_request_routed): in a burst, the next routing task must
    already see them gone. If another replica ends up taking the request (the chosen one rejected
    it as full), the reservation moves there.

    Tunables are class attributes; request_router_kwargs may override STATS_MAX_AGE_S,
    MAX_HOLD_S and ADMISSION per deployment (stats_max_age_s, max_hold_s, admission), and tests
    pass clock:

        RequestRouterConfig(request_router_class="deployments.router:KVBlockRouter",
                            request_routing_stats_period_s=0.2,
                            request_routing_stats_timeout_s=0.2,
                            request_router_kwargs={"stats_max_age_s": 1.0, "max_hold_s": 10.0,
                                                   "admission": "engine"})
    """

    STATS_MAX_AGE_S = 1.0
    """A report older than this is ignored. Reports reach the router through the controller (its
    0.1 s control loop, then a broadcast): at a 0.2 s period they arrived 0.1-0.35 s old on an
    idle local cluster. About 3x the period plus a few loop ticks."""

    MAX_HOLD_S = 10.0
    """How long a request may wait here while no replica has room for it; then it goes to the
    replica closest to having room, whose engine queues it. 0: never hold."""

    HOLD_POLL_S = 0.02
    """How often a held request looks again: completions seen here free blocks at once, reports
    arrive every stats period."""

    CLAIM_TTL_S = 10 * HOLD_POLL_S
    """A held request's claim lapses when no poll renewed it for this long (its routing task is
    gone); routing or cancelling it ends the claim at once."""

    ADMISSION = "engine"
    """How a request's blocks are counted, one of ADMISSIONS (class docstring)."""

    FALLBACK_BLOCK_SIZE = DEFAULT_BLOCK_SIZE
    """Converts a send to blocks before the replica has ever reported its block size."""

    _HELD_SINCE = "ponytail_held_since"  # attribute set on a held request's routing_context
    _HOLD_LOGGED = "ponytail_hold_logged"  # ... once its hold went into HOLDS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock: Callable[[], float] = time.time
        self.stats_max_age_s = self.STATS_MAX_AGE_S
        self.max_hold_s = self.MAX_HOLD_S
        self.admission = self.ADMISSION
        self._ledgers: dict[ReplicaID, Ledger] = {}
        self._reservations: dict[int, Reservation] = {}  # id(PendingRequest) -> blocks reserved at choice
        self._claims: dict[int, Claim] = {}  # id(PendingRequest) -> what the held request waits for

    def initialize_state(self, clock: Callable[[], float] | None = None, stats_max_age_s: float | None = None,
                         max_hold_s: float | None = None, admission: str | None = None, **unknown):
        """Takes `request_router_config.request_router_kwargs`."""
        if unknown:
            raise ValueError(f"request_router_kwargs {sorted(unknown)} are not known to KVBlockRouter; expected: "
                             f"stats_max_age_s (seconds), max_hold_s (seconds), admission ({' | '.join(ADMISSIONS)}), "
                             "clock (tests)")
        if admission is not None:
            if admission not in ADMISSIONS:
                raise ValueError(f"request_router_kwargs admission={admission!r}; allowed: {', '.join(ADMISSIONS)}")
            self.admission = admission
        if stats_max_age_s is not None:
            self.stats_max_age_s = _seconds("stats_max_age_s", stats_max_age_s, allow_zero=False)
        if max_hold_s is not None:
            self.max_hold_s = _seconds("max_hold_s", max_hold_s, allow_zero=True)
        if clock is not None:
            self.clock = clock

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Every live candidate, one per rank, best first (see the class docstring)."""
        if pending_request is not None:
            # Lets Ray back off between rounds when every replica is full (it spins otherwise).
            pending_request.routing_context.should_backoff = True
        now = self.clock()
        # All the tokens it may come to hold, and those counted now (fewer under admission "engine"):
        # a pool too small for all of them is no place to hold it for.
        whole = request_tokens(pending_request, reserve=self.counts_output)
        tokens = whole - self.uncounted_tokens(pending_request) if whole is not None else None
        # Claim.arrival; id() breaks created_at ties, and a claim keeps its request (so its id) alive.
        arrival = (pending_request.created_at, id(pending_request)) if pending_request is not None else (math.inf, 0)
        claimed = self._claimed_before(arrival, now)
        fits, unknown, short = [], [], []
        could_ever_fit = False  # some replica's whole pool holds the request
        for replica in candidate_replicas:
            replica_id = replica.replica_id
            if replica_id not in self._replicas:  # died after the caller took its list
                continue
            ledger = self._ledger(replica_id)
            report = read_report(replica.routing_stats)
            if report is not None:
                ledger.observe(report)
            if report is None or now - report.time > self.stats_max_age_s:
                unknown.append(((self._queue_len(replica_id, ledger),
                                 -self._stale_affinity(replica, report, pending_request), random.random()), replica))
                continue
            reported = report.free_blocks if self.counts_output else report.startable_blocks
            free = reported - ledger.unreported_blocks - claimed.get(replica_id, 0)
            placement = self._placement(replica, report, free, tokens, pending_request)
            need = placement.need
            later = blocks_needed(whole, report.block_size) - blocks_needed(tokens, report.block_size)
            pool_fits = report.total_blocks <= 0 or need + later <= report.total_blocks
            could_ever_fit |= pool_fits
            if free >= need:
                # Requests routed since the report count as load the report cannot show.
                load = max(report.load + len(ledger.sends), ledger.num_in_flight)
                used = 1 - free / report.total_blocks if report.total_blocks > 0 else 0.0
                fits.append((used - placement.affinity, load, free, replica))
            else:
                short.append(((need - free, report.load, random.random()), replica, need, pool_fits))
        if not fits and not unknown and could_ever_fit and tokens is not None and self._hold(pending_request, now):
            self._claim(pending_request, arrival, now, short)
            try:
                await asyncio.sleep(self.HOLD_POLL_S)
            except asyncio.CancelledError:  # the request was cancelled or routed by another task
                self._claims.pop(id(pending_request), None)
                raise
            return []
        most_load = max((load for _, load, _, _ in fits), default=0) or 1
        scored = [((used + load / most_load, -free, random.random()), replica) for used, load, free, replica in fits]
        return [[entry[1]] for tier in (scored, unknown, short)
                for entry in sorted(tier, key=lambda entry: entry[0])]

    def _claimed_before(self, arrival: tuple[float, int], now: float) -> dict[ReplicaID, int]:
        """The oldest claim's blocks on its replica, when it arrived before `arrival` (see the class
        docstring); drops the claims that lapsed or whose request is done."""
        head = None
        for key, claim in list(self._claims.items()):
            if now - claim.renewed > self.CLAIM_TTL_S or claim.pending.future.done():
                del self._claims[key]
            elif head is None or claim.arrival < head.arrival:
                head = claim
        return {head.replica_id: head.blocks} if head is not None and head.arrival < arrival else {}

    def _claim(self, pending_request: PendingRequest, arrival: tuple[float, int], now: float, short: list) -> None:
        """Claims (or renews the claim on) the replica closest to fitting the held request; `short`
        holds every replica here, and one whose pool can hold the request (else it is not held)."""
        previous = self._claims.get(id(pending_request))
        current = previous.replica_id if previous is not None else None
        _, replica, need, _ = min((entry for entry in short if entry[3]), key=lambda entry: (
            entry[0][0], entry[1].replica_id != current, entry[0][1:]))  # deficit, the claim held, load
        self._claims[id(pending_request)] = Claim(pending_request, replica.replica_id, need, arrival, now)

    def _hold(self, pending_request: PendingRequest | None, now: float) -> bool:
        """Keep the request here for another poll: no replica has room now, and it has waited
        less than max_hold_s (see the class docstring)."""
        if pending_request is None or self.max_hold_s <= 0:
            return False
        context = pending_request.routing_context
        since = getattr(context, self._HELD_SINCE, None)
        if since is None:
            setattr(context, self._HELD_SINCE, now)
            since = now
        if now - since >= self.max_hold_s:
            return False
        context.should_backoff = False  # we poll every HOLD_POLL_S; Ray's backoff would grow to 0.5 s
        return True

    def _get_pending_request_matching_metadata(self, request_metadata=None) -> PendingRequest | None:
        """FIFOMixin's hook: the pending request whose ranking chose the replica (see the class
        docstring); None sends the replica to the oldest pending request instead. The deque holds
        the requests waiting for a replica, a handful even in a burst."""
        if request_metadata is None:
            return None
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                return pending
        return None

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        """FIFOMixin's hand-over of a chosen replica, and the blocks reserved for it at once: the
        request reaches the replica a round trip later (Ray's rejection protocol), and in a burst
        other routing tasks rank their requests meanwhile (they would all see the same free blocks)."""
        target = self._get_pending_request_matching_metadata(request_metadata) or next(
            (p for p in self._pending_requests_to_fulfill if not p.future.done()), None)
        super()._fulfill_next_pending_request(replica, request_metadata)
        if target is not None and target.future.done() and not target.future.cancelled() \
                and target.future.result() is replica:
            self._reserve(target, replica.replica_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """The replica accepted the request: in flight there until completed.

        Ray calls this after the rejection protocol's round trip (always on, except from a Ray
        Client driver, where the ledger stays empty). The blocks were reserved when the replica
        was chosen; if another replica took the request (the chosen one was full), they move.
        """
        if replica_id not in self._replicas:
            return
        reservation = self._reservations.get(id(pending_request))
        if reservation is None or reservation.pending is not pending_request \
                or reservation.replica_id != replica_id:
            reservation = self._reserve(pending_request, replica_id)  # moves one made elsewhere
        del self._reservations[id(pending_request)]
        self._ledger(replica_id).start(pending_request.metadata.internal_request_id, reservation.entry,
                                       reservation.grown)

    def _reserve(self, pending_request: PendingRequest, replica_id: ReplicaID) -> Reservation:
        self._claims.pop(id(pending_request), None)  # routed: its blocks are the ledger's now
        now = self.clock()
        stale = [key for key, r in self._reservations.items() if now - r.entry[0] > self.stats_max_age_s]
        for key in stale:  # never routed (cancelled): a newer report has dropped their blocks anyway
            del self._reservations[key]
        previous = self._reservations.get(id(pending_request))
        if previous is not None and previous.pending is pending_request:  # chosen again after a rejection
            self._ledger(previous.replica_id).unreserve(previous.entry)
        ledger = self._ledger(replica_id)
        # Any report fresh enough to be used drops these sends anyway; a replica that never
        # reports again must not grow its ledger forever.
        ledger.forget(now - self.stats_max_age_s)
        replica = self._replicas.get(replica_id)
        report = read_report(replica.routing_stats) if replica is not None else None
        if report is not None:
            ledger.observe(report)
        entry = ledger.reserve(now, self._reserved_blocks(pending_request, replica_id, report))
        reservation = self._reservations[id(pending_request)] = Reservation(
            pending_request, replica_id, entry, self._grown_blocks(pending_request, report))
        context = pending_request.routing_context
        since = getattr(context, self._HELD_SINCE, None)
        if since is not None and not getattr(context, self._HOLD_LOGGED, False):  # once, not per rejection
            setattr(context, self._HOLD_LOGGED, True)
            hold_log().append(HeldRequest(replica_id.unique_id, entry[1], now - since))
        return reservation

    def _placement(self, replica: RunningReplica, report: Report, free: int, tokens: int | None,
                   pending_request: PendingRequest | None) -> Placement:
        """The blocks the request takes on a replica with a fresh report, and what its score loses
        (subclasses that know more than the request's size: prefix_router.py)."""
        return Placement(need=blocks_needed(tokens, report.block_size))

    def _stale_affinity(self, replica: RunningReplica, report: Report | None,
                        pending_request: PendingRequest | None) -> int:
        """Among replicas whose report is stale or missing (ranked by queue length), what breaks a
        tie before chance: nothing here; the prompt's cached blocks in prefix_router.py."""
        return 0

    def _reserved_blocks(self, pending_request: PendingRequest, replica_id: ReplicaID, report: Report | None) -> int:
        """Blocks the ledger takes off the replica the request was chosen for."""
        block_size = report.block_size if report is not None else self.FALLBACK_BLOCK_SIZE
        return blocks_needed(request_tokens(pending_request, self.counts_output, self.counts_output), block_size)

    def _grown_blocks(self, pending_request: PendingRequest, report: Report | None) -> int:
        """Blocks the request's output adds beyond those reserved for it (admission "engine"
        reserves each sample's first token): it frees them too when it completes, and a held
        request must not wait for the next report to see them. Counted to max_tokens; one that
        stopped early frees fewer, which the next report corrects."""
        whole = request_tokens(pending_request)
        if whole is None:
            return 0
        block_size = report.block_size if report is not None else self.FALLBACK_BLOCK_SIZE
        return blocks_needed(whole, block_size) - blocks_needed(whole - self.uncounted_tokens(pending_request),
                                                                block_size)

    def uncounted_tokens(self, pending_request: PendingRequest | None) -> int:
        """Tokens of the request's size not counted when placing it: admission "engine" counts each
        sample's first token, not its max_tokens."""
        if self.counts_output:
            return 0
        whole, first = output_tokens(pending_request), output_tokens(pending_request, output=False)
        return whole - first if whole is not None else 0

    @property
    def counts_output(self) -> bool:
        """Requests count their max_tokens (admission "max_tokens"), not just their first token."""
        return self.admission == "max_tokens"

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        ledger = self._ledgers.get(replica_id)
        if ledger is not None:
            ledger.complete(self.clock(), internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._ledgers.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for replica_id in [rid for rid in self._ledgers if rid not in self._replicas]:
            del self._ledgers[replica_id]

    def _ledger(self, replica_id: ReplicaID) -> Ledger:
        ledger = self._ledgers.get(replica_id)
        if ledger is None:
            ledger = self._ledgers[replica_id] = Ledger()
        return ledger

    def _queue_len(self, replica_id: ReplicaID, ledger: Ledger) -> int:
        cached = self.replica_queue_len_cache.get(replica_id)
        return max(cached or 0, ledger.num_in_flight)


def _seconds(name: str, value: Any, allow_zero: bool) -> float:
    """A request_router_kwargs duration, checked."""
    if not is_seconds(value) or (value == 0 and not allow_zero):
        raise ValueError(f"request_router_kwargs {name}={value!r}; expected seconds "
                         f"{'>= 0' if allow_zero else '> 0'}")
    return float(value)
