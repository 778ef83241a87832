"""The baseline side: what users run without Ponytail, plain `model.generate` on batches of the
requests (transformers' DynamicCache, left padding), timed per step through a streamer."""

from __future__ import annotations

import time
from typing import Callable

import torch
from transformers.generation.streamers import BaseStreamer

from .speed import RequestTiming, SpeedStats, speed_stats
from .workload import Workload


class StepClock(BaseStreamer):
    """generate() hands the streamer the prompt once, then each step's new tokens: record when
    each step's tokens reached the host."""

    def __init__(self, on_step: Callable[[int], None]):
        self.times: list[float] = []
        self._on_step = on_step
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self._on_step(len(self.times))

    def end(self) -> None:
        pass


def run_generate(model, workload: Workload, batch_size: int, pad_token_id: int,
                 on_done: Callable[[int], None]) -> SpeedStats:
    """Every request through plain generate, `batch_size` at a time, greedy, EOS ignored.

    A batch runs until its longest request is done (what static batching costs: shorter requests'
    rows keep computing). on_done(n): n more requests have all their tokens. Ctrl-C stops it with
    the tokens produced so far.
    """
    device = next(model.parameters()).device
    timings: list[RequestTiming] = []
    done = 0
    interrupted = False
    t0 = time.perf_counter()
    for start in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[start:start + batch_size]
        lens = workload.output_lens[start:start + batch_size]
        clock = StepClock(lambda step, lens=lens: on_done(sum(n == step for n in lens)))
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        try:
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=False, eos_token_id=None, pad_token_id=pad_token_id, streamer=clock)
        except KeyboardInterrupt:
            interrupted = True
        for n in lens:
            produced = min(n, len(clock.times))
            timings.append(RequestTiming(clock.times[0] - t0 if produced else None,
                                         clock.times[produced - 1] - t0 if produced else None, produced))
            done += produced == n
        if interrupted:
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return speed_stats("generate", timings, time.perf_counter() - t0, len(workload.prompts), done, interrupted,
                       note=f"batches of {batch_size}")
