"""What an engine replica reports: the routing stats its routers read every period, and its whole
state in one answer (EngineReplica.report) for operators, tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ponytail import EngineStats

from deployments.api.protocol import ModelInfo


@dataclass(slots=True)
class ReplicaReport:
    """One engine replica's state in one answer (EngineReplica.report): for operators, tests, benchmarks."""

    replica: str  # the replica's Ray actor name
    info: ModelInfo  # model, device and device UUID
    routing: dict[str, Any]  # what record_routing_stats() returns now: the numbers the router reads
    num_requests: int  # generate calls this replica has taken since it started
    stats: EngineStats  # the engine's counters (blocks, running, waiting, preemptions, ...)
    num_steps: int = 0  # engine steps driven since the replica started
    step_seconds: float = 0.0  # their time in the engine's worker thread (device waits included)
    admit_seconds: float = 0.0  # summed over generate calls: from the call to the engine taking it (tokenizing)
    ttft_seconds: float = 0.0  # summed over finished requests: from the engine taking it to its first token
    queue_seconds: float = 0.0  # the part of ttft_seconds before each request's first step (waiting to run)
    num_ttft: int = 0  # finished requests in ttft_seconds


# Keys of a replica's record_routing_stats() dict, read by the router.
ADMISSIONS = ("engine", "max_tokens")  # how the KV-block router counts a request's blocks (router.py)
STAT_FREE_BLOCKS = "free_blocks"  # free once every request here reaches max_tokens (admission max_tokens)
STAT_STARTABLE_BLOCKS = "startable_blocks"  # a new prompt may take now, behind the queue (engine accounting)
STAT_TOTAL_BLOCKS = "total_blocks"
STAT_NUM_RUNNING = "num_running"
STAT_NUM_WAITING = "num_waiting"
STAT_BLOCK_SIZE = "block_size"
STAT_TIME = "time"  # time.time() on the replica when the stats were read
# The prefix cache, for the prefix-aware router (prefix_publisher.py writes them).
STAT_PREFIX_SEQ = "prefix_seq"  # sequence number of the newest prefix-cache event (0: none yet)
STAT_PREFIX_EVENTS = "prefix_events"  # [(block hash, stored)] ending at prefix_seq, oldest first
STAT_CACHED_BLOCKS = "cached_blocks"  # of free_blocks, those holding cached prefixes (evicted when taken)
