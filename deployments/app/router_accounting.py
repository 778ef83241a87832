"""What the KV-block router counts: replicas' reports, requests' blocks, and per replica what this
router sent and saw complete since its latest report (the ledger)."""

from __future__ import annotations

import importlib
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID

from deployments.api.protocol import GenerateRequest

from .routing_stats import (STAT_BLOCK_SIZE, STAT_FREE_BLOCKS, STAT_NUM_RUNNING, STAT_NUM_WAITING,
                            STAT_STARTABLE_BLOCKS, STAT_TIME, STAT_TOTAL_BLOCKS)

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
    output=False each sample's first token only; None when arg 0 is not a GenerateRequest. Reads no
    prompt.

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
    samples = max(sampling.n, sampling.best_of or 1)
    return samples * (sampling.max_tokens if output else 1)


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
    """The blocks a held request waits for on one replica (the oldest claim counts: router.py)."""

    pending: PendingRequest
    replica_id: ReplicaID
    blocks: int  # the held request's need there
    arrival: tuple[float, int]  # (created_at, id): claims of requests that arrived first take precedence
    renewed: float  # router clock of the last poll that held the request
