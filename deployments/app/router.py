"""KVBlockRouter: sends each generate request to a lightly loaded engine replica with room for its KV blocks.

Ray Serve builds one router in every process that holds a handle to the engine deployment (the
ingress replicas, other Ray apps, Serve's proxy where the replicas serve the API) from the
engine's `request_router_config`; KVBlockRouter's docstring shows the config to use.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Any, Callable

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ponytail import DEFAULT_BLOCK_SIZE, is_seconds

from .router_accounting import (Claim, HeldRequest, Ledger, Placement, Report, Reservation, blocks_needed, hold_log,
                                output_tokens, read_report, request_tokens)
from .routing_stats import ADMISSIONS


class KVBlockRouter(FIFOMixin, RequestRouter):
    """Ranks engine replicas by the KV-cache blocks they have free for this request.

    Each replica reports its free blocks every stats period (record_routing_stats); this router
    subtracts what it sent since (the ledger) and ranks: fresh reports with room first (lowest
    pool use + load), then unreported or stale replicas (fewest queued), then fresh ones without
    room (smallest deficit). When every replica is fresh and full, a request is held here up to
    max_hold_s and goes to whichever frees blocks first; the oldest held request claims the
    replica closest to fitting it. docs/serving.md ("Routing", "How KVBlockRouter ranks replicas,
    holds requests and claims blocks") has the whole rule and why. Tunables are class attributes;
    request_router_kwargs may override stats_max_age_s, max_hold_s and admission per deployment,
    and tests pass clock:

        RequestRouterConfig(request_router_class="deployments.app.router:KVBlockRouter",
                            request_routing_stats_period_s=0.2, request_routing_stats_timeout_s=0.2,
                            request_router_kwargs={"max_hold_s": 10.0, "admission": "engine"})
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
