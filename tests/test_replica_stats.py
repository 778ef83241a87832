"""What an engine replica reports to the KV-block router, read from the engine's own stats.

The replica used to walk the scheduler's lists from the event loop's thread; now the engine keeps
the count. These tests pin the numbers for a known engine state: free = admissible - promised.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ponytail import SamplingParams

pytest.importorskip("ray.serve")
import ray  # noqa: E402

from deployments.app.replica import EngineReplica  # noqa: E402

BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4  # layers * (K, V) * kv_heads * head_dim * float32 * 4 tokens


@pytest.fixture()
def replica():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    # 64 blocks of 4 tokens (a 1-block chunk each); two requests run at once.
    return EngineReplica(model, engine=dict(device="cpu", kv_cache_memory=64 * BLOCK_BYTES, max_num_seqs=2,
                                            max_model_len=64, block_size=4), served_model_name="random-llama")


def walked(replica) -> tuple[int, int]:
    """(free_blocks, total_blocks) as the replica computed them before the engine reported them:
    from the pool's allocator and storage and the scheduler's lists."""
    engine = replica.llm.engine
    cache, scheduler, block_size = engine.cache, engine.scheduler, replica.info.block_size
    promised = 0
    for requests, running in ((list(scheduler.waiting), False), (list(scheduler.running), True)):
        for r in requests:
            need = -(-(len(r.prompt_token_ids) + r.params.max_tokens) // block_size)
            held = -(-r.num_tokens // block_size) if running else 0
            promised += max(0, need - held)
    growable = (cache.max_chunks - cache.num_chunks) * cache.storage.chunk_blocks
    return (max(0, cache.allocator.num_free + growable - promised),
            cache.max_chunks * cache.storage.chunk_blocks)


def routing(replica) -> tuple[int, int]:
    stats = replica.record_routing_stats()
    return stats["free_blocks"], stats["total_blocks"]


def add_three_requests(replica):
    """A, B, C queued on the replica's engine (greedy, EOS ignored); returns the engine."""
    engine = replica.llm.engine
    greedy = dict(temperature=0, ignore_eos=True)
    engine.add_request(list(range(10, 20)), SamplingParams(max_tokens=6, **greedy))  # A: 10 + 6 tokens, 4 blocks
    engine.add_request(list(range(30, 35)), SamplingParams(max_tokens=3, **greedy))  # B: 5 + 3 tokens, 2 blocks
    engine.add_request(list(range(40, 47)), SamplingParams(max_tokens=9, **greedy))  # C: 7 + 9 tokens, 4 blocks
    return engine


def test_routing_stats_equal_the_walked_numbers_for_a_known_engine_state(replica):
    engine = add_three_requests(replica)
    # Nothing ran yet: the pool holds one block of 64 and every request is promised all its blocks.
    stats = replica.llm.stats()
    assert (stats.max_blocks, stats.admissible_blocks, stats.promised_blocks) == (64, 64, 10)
    assert routing(replica) == walked(replica) == (64 - 10, 64)

    engine.step()  # A and B prefill (3 + 2 blocks) and sample a token each; C waits (max_num_seqs=2)
    stats = replica.llm.stats()
    assert (stats.total_blocks, stats.free_blocks, stats.admissible_blocks) == (5, 0, 59)
    assert stats.promised_blocks == (4 - 3) + (2 - 2) + 4  # A holds 11 tokens' blocks, B 6's; C none
    assert routing(replica) == walked(replica) == (59 - 5, 64)

    engine.step()
    engine.step()  # A reaches 13 tokens (a 4th block); B finishes, its 2 blocks are free again
    stats = replica.llm.stats()
    assert (stats.free_blocks, stats.admissible_blocks, stats.promised_blocks) == (2, 61, 0 + 4)
    assert routing(replica) == walked(replica) == (61 - 4, 64)

    while engine.has_unfinished():
        engine.step()
        assert routing(replica) == walked(replica)
    assert replica.llm.stats().promised_blocks == 0 and routing(replica) == (64, 64)


def test_free_blocks_never_go_below_zero(replica):
    engine = replica.llm.engine
    for i in range(8):  # 8 * 16 blocks promised, 64 in the pool
        engine.add_request([10 + i] * 4, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    stats = replica.llm.stats()
    assert stats.admissible_blocks - stats.promised_blocks == 64 - 8 * 16
    assert routing(replica) == walked(replica) == (0, 64)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    assert routing(replica) == (64, 64)


def test_model_info_comes_from_public_llm_properties(replica):
    info = replica.info
    assert (info.model_id, info.max_model_len, info.block_size, info.device, info.device_uuid) == (
        "random-llama", 64, 4, "cpu", None)
    assert (replica.llm.max_model_len, replica.llm.block_size, str(replica.llm.device)) == (64, 4, "cpu")


def test_a_replicas_engine_keeps_its_conversations_prefixes_unless_told_otherwise(replica):
    """The serving default (SERVING_ENGINE_DEFAULTS) under the replica's own engine arguments."""
    assert replica.llm.config.cache.keep_prefix_cache is True and replica.llm.engine.cache.keep_prefixes


def test_the_report_splits_time_to_first_token_into_waiting_and_the_first_steps(replica):
    from ponytail.engine.request import CompletionOutput, RequestMetrics, RequestOutput

    def finished(arrival, scheduled, first_token):
        metrics = RequestMetrics(arrival, first_scheduled_time=scheduled, first_token_time=first_token,
                                 last_token_time=first_token, finished_time=arrival + 1.0)
        return RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "ab", [4, 5], "length")], True,
                             metrics)

    replica._finished(finished(10.0, 10.25, 10.5))  # waited 0.25 s for its first step, first token 0.25 s later
    replica._finished(finished(20.0, 20.0, 20.125))  # ran at once
    aborted = finished(30.0, None, None)
    replica._finished(aborted)  # never got a token: counts in neither sum
    report = replica.report()
    assert (report.num_ttft, report.ttft_seconds, report.queue_seconds) == (2, 0.625, 0.25)
    assert report.replica == "local" and not ray.is_initialized()  # reporting started no Ray cluster


def test_startable_blocks_count_the_waiting_queue_ahead(replica):
    """startable = admissible - blocks the waiting requests' tokens take - decode headroom (0 for a
    64-block pool: 1% rounds down); a preempted request's generated tokens count too."""
    engine = add_three_requests(replica)  # prompts of 3, 2 and 2 blocks
    stats = replica.llm.stats()
    assert (stats.queued_blocks, stats.headroom_blocks, stats.startable_blocks) == (7, 0, 64 - 7)
    assert replica.record_routing_stats()["startable_blocks"] == 57

    engine.step()  # A and B run (3 + 2 blocks taken), C waits
    stats = replica.llm.stats()
    assert (stats.admissible_blocks, stats.queued_blocks, stats.startable_blocks) == (59, 2, 57)

    scheduler = engine.scheduler
    victim = scheduler.running.pop()  # B, 6 tokens now: back to the queue's head as the scheduler preempts
    scheduler._preempt(victim)
    stats = replica.llm.stats()
    assert (stats.admissible_blocks, stats.queued_blocks) == (61, 2 + 2)
    assert replica.record_routing_stats()["startable_blocks"] == 61 - 4

    for request_id in list(engine.requests):
        engine.abort(request_id)
    stats = replica.llm.stats()
    assert (stats.queued_blocks, stats.startable_blocks) == (0, 64)
