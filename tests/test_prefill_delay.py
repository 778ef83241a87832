"""prefill_delay_factor (engine/scheduler.py): while requests decode, new prompts wait until the
oldest has waited factor x what a prefill step costs beyond the decode step (the step overhead
measured at start-up where CUDA graphs run, else the last prefill step), so prompts arriving close
together share one step without CUDA graphs. The scheduler's clock is injected: no test here
sleeps or times anything."""

import pytest

import ponytail
from ponytail import ConfigError, SamplingParams
from ponytail.engine.scheduler import MAX_PREFILL_DELAY_S
from ponytail.runner.step_overhead import StepOverhead


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def engine_with_clock(tiny_model, factor):
    model, tokenizer = tiny_model
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="16MiB", max_num_seqs=8, max_model_len=512,
                       tuning={"prefill_delay_factor": factor})
    clock = Clock()
    llm.engine.scheduler.clock = clock
    return llm.engine, clock


def add(engine, clock, name: str, prompt_len: int = 20, max_tokens: int = 40):
    first = 100 * (ord(name) - ord("a")) + 1  # prompts share no block: no prefix-cache hits
    request = engine.add_request(list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                               ignore_eos=True), request_id=name)
    request.metrics.arrival_time = clock.now  # the engine stamps time.monotonic(); the test's clock instead
    return request


def step_at(engine, clock, now: float) -> list[tuple[str, int]]:
    """One engine step at `now`; what the scheduler put in it: (request id, tokens)."""
    clock.now = now
    seen = []
    schedule = engine.scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if out is not None:
            seen.extend((c.request.request_id, c.num_tokens) for c in out.chunks)
        return out

    engine.scheduler.schedule = recording
    try:
        engine.step()
    finally:
        engine.scheduler.schedule = schedule
    return seen


def test_a_prompt_waits_for_the_last_prefill_steps_time_while_others_decode(tiny_model):
    engine, clock = engine_with_clock(tiny_model, 1.0)
    add(engine, clock, "a")
    assert step_at(engine, clock, 0.0) == [("a", 20)]  # nothing decodes: no wait
    assert step_at(engine, clock, 0.010) == [("a", 1)]  # the prefill step took 10 ms
    assert engine.scheduler.prefill_step_s == pytest.approx(0.010)
    clock.now = 0.012
    add(engine, clock, "b", prompt_len=30)
    assert step_at(engine, clock, 0.015) == [("a", 1)]  # b waited 3 ms of 10: held, a decodes alone
    clock.now = 0.016
    add(engine, clock, "c", prompt_len=25)
    assert step_at(engine, clock, 0.020) == [("a", 1)]  # b waited 8 ms
    # b has waited 10.5 ms: b and c share one prefill step
    assert step_at(engine, clock, 0.0225) == [("a", 1), ("b", 30), ("c", 25)]
    assert step_at(engine, clock, 0.030) == [("a", 1), ("b", 1), ("c", 1)]
    assert engine.scheduler.prefill_step_s == pytest.approx(0.0075)


def test_a_step_that_prefills_anyway_takes_waiting_prompts_at_once(tiny_model):
    engine, clock = engine_with_clock(tiny_model, 1.0)
    engine.scheduler.max_num_batched_tokens = 16  # a's 40-token prompt takes three steps
    engine.scheduler.prefill_only_batched_tokens = 16
    engine.scheduler.context_cost = 0.0  # every token counts one (the CPU's default counts context too)
    add(engine, clock, "a", prompt_len=40)
    assert step_at(engine, clock, 0.0) == [("a", 16)]
    add(engine, clock, "b", prompt_len=8)  # arrives at 0.0 and has waited nothing
    assert step_at(engine, clock, 0.001) == [("a", 16)]  # the budget is spent on a's prefill
    # a's last chunk leaves budget: b joins the step at once, the step has no graphs anyway
    assert step_at(engine, clock, 0.002) == [("a", 8), ("b", 8)]


def test_the_wait_is_bounded_and_factor_zero_never_waits(tiny_model):
    engine, clock = engine_with_clock(tiny_model, 50.0)
    add(engine, clock, "a")
    step_at(engine, clock, 0.0)
    step_at(engine, clock, 1.0)  # a 1 s prefill step: 50 s of wait, capped
    clock.now = 1.0
    add(engine, clock, "b")
    assert ("b", 20) not in step_at(engine, clock, 1.0 + MAX_PREFILL_DELAY_S / 2)
    assert ("b", 20) in step_at(engine, clock, 1.0 + MAX_PREFILL_DELAY_S)

    engine, clock = engine_with_clock(tiny_model, 0.0)
    add(engine, clock, "a")
    step_at(engine, clock, 0.0)
    step_at(engine, clock, 1.0)
    add(engine, clock, "b")
    assert ("b", 20) in step_at(engine, clock, 1.0)


def test_outputs_are_the_same_with_and_without_the_wait(tiny_model):
    model, tokenizer = tiny_model
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 9, 30)]
    outputs = []
    for factor in (0.0, 1.0):
        llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="16MiB", max_num_seqs=8, max_model_len=512,
                           tuning={"prefill_delay_factor": factor})
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]


def test_the_default_and_bad_values(tiny_model):
    model, tokenizer = tiny_model
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="16MiB", max_num_seqs=4, max_model_len=256)
    assert llm.engine.scheduler.prefill_delay_factor == 0.0  # no CUDA graphs on the CPU: every step costs alike
    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(ConfigError, match=r"prefill_delay_factor=.* is not supported; allowed: a number >= 0"):
            ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="16MiB", max_num_seqs=4, max_model_len=256,
                         tuning={"prefill_delay_factor": bad})


def test_prompts_that_fill_the_step_do_not_wait(tiny_model):
    engine, clock = engine_with_clock(tiny_model, 1.0)
    engine.scheduler.context_cost = 0.0  # every token counts one budget unit
    engine.scheduler.max_num_batched_tokens = 64
    add(engine, clock, "a")
    assert step_at(engine, clock, 0.0) == [("a", 20)]
    assert step_at(engine, clock, 0.010) == [("a", 1)]  # the prefill step took 10 ms: later prompts wait up to that
    clock.now = 0.011
    add(engine, clock, "b", prompt_len=30)
    assert step_at(engine, clock, 0.012) == [("a", 1)]  # 30 tokens leave room in the 63 after a's row: b waits
    add(engine, clock, "c", prompt_len=33)  # b and c together take all 63: nothing could join them
    assert step_at(engine, clock, 0.013) == [("a", 1), ("b", 30), ("c", 33)]


def test_prompts_that_take_every_free_seat_do_not_wait(tiny_model):
    engine, clock = engine_with_clock(tiny_model, 1.0)
    engine.scheduler.max_num_seqs = 3
    add(engine, clock, "a")
    step_at(engine, clock, 0.0)
    step_at(engine, clock, 0.010)
    clock.now = 0.011
    add(engine, clock, "b", prompt_len=5)
    assert step_at(engine, clock, 0.012) == [("a", 1)]  # a seat is still free after b: b waits
    add(engine, clock, "c", prompt_len=5)  # the last free seat
    assert step_at(engine, clock, 0.013) == [("a", 1), ("b", 5), ("c", 5)]


def test_with_a_measured_step_overhead_a_prompt_waits_for_that_at_the_steps_decode_rows(tiny_model):
    engine, clock = engine_with_clock(tiny_model, 2.0)
    assert engine.scheduler.step_overhead is None  # no CUDA graphs on the CPU: nothing measured
    # What a step with a prompt costs beyond the replay: 3 ms at 1 decode row, 1 ms at 3.
    engine.scheduler.step_overhead = StepOverhead(rows=(1, 3), seconds=(0.003, 0.001))
    add(engine, clock, "a")
    assert step_at(engine, clock, 0.0) == [("a", 20)]
    assert step_at(engine, clock, 0.050) == [("a", 1)]  # a 50 ms prefill step: the old rule would hold b 100 ms
    clock.now = 0.051
    add(engine, clock, "b", prompt_len=30)
    assert step_at(engine, clock, 0.056) == [("a", 1)]  # 5 ms of 2 x 3 ms at one decode row: held
    assert step_at(engine, clock, 0.057) == [("a", 1), ("b", 30)]  # 6 ms
    clock.now = 0.057
    add(engine, clock, "c", prompt_len=25)
    clock.now = 0.058
    add(engine, clock, "d", prompt_len=25)
    # Two rows decode now: 2 ms of overhead, a 4 ms wait.
    assert step_at(engine, clock, 0.060) == [("a", 1), ("b", 1)]  # c has waited 3 ms
    assert step_at(engine, clock, 0.062) == [("a", 1), ("b", 1), ("c", 25), ("d", 25)]  # 5 ms: c and d share a step
