"""Beam search as vLLM's LLM.beam_search runs it: one token a step for every live beam, as a
request of its own, so the beams of a prompt share its cached blocks through the prefix cache.

Each step every beam asks for its 2 x beam_width most likely next tokens (their raw logprobs); a
candidate's score is its summed logprob over (tokens, the prompt's included, an EOS at the end
not counted) ** length_penalty, and the beam_width best candidates of a prompt live on. A
candidate ending in EOS is complete (unless ignore_eos); after max_tokens steps the beam_width
best of the complete and live ones are the answer, best first.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ConfigError
from ..sampling.params import MAX_LOGPROBS, SamplingParams


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams: the beams kept a step, the tokens a beam may add, and the rest."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        widest = MAX_LOGPROBS // 2  # each beam asks for 2 x beam_width logprobs
        for name, value, low, high in (("beam_width", self.beam_width, 1, widest),
                                       ("max_tokens", self.max_tokens, 1, None)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                raise ConfigError(f"{name}={value!r} is not supported; allowed: an integer from {low}"
                                  + (f" to {high}" if high else " up"))
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) \
                or not math.isfinite(self.length_penalty):
            raise ConfigError(f"length_penalty={self.length_penalty!r} is not supported; allowed: a finite number")


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: its tokens (the prompt's first), per generated token the logprobs it was chosen
    from, their sum, and once returned its text and why it ended."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | None = None  # the EOS token that ended it


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's answer: its beam_width best sequences, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(sequence: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    length = len(sequence.tokens) - (1 if sequence.tokens[-1] in eos_token_ids else 0)
    return sequence.cum_logprob / (length ** length_penalty)


# generate([(prompt index, a beam's token ids)], one SamplingParams for all) -> one output each, in order
Generate = Callable[[list[tuple[int, list[int]]], SamplingParams], list[Any]]


class BeamSearch:
    """The search's state between steps, for any driver: beams() names the next step's one-token
    requests, advance() takes their outputs in that order, results() ranks what is left."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: frozenset[int]):
        self.prompts, self.params, self.eos_token_ids = [list(p) for p in prompts], params, eos_token_ids
        self.step_params = SamplingParams(max_tokens=1, temperature=params.temperature,
                                          logprobs=2 * params.beam_width, ignore_eos=True)
        self.steps = 0
        self._live = [[BeamSearchSequence(tokens=list(prompt))] for prompt in self.prompts]
        self._complete: list[list[BeamSearchSequence]] = [[] for _ in self.prompts]
        self._asked: list[tuple[int, BeamSearchSequence]] = []

    def score(self, sequence: BeamSearchSequence) -> float:
        return beam_score(sequence, self.eos_token_ids, self.params.length_penalty)

    def beams(self) -> list[tuple[int, list[int]]]:
        """(prompt index, token ids) of every live beam; empty once the search is over."""
        if self.steps >= self.params.max_tokens:
            return []
        self._asked = [(index, beam) for index, group in enumerate(self._live) for beam in group]
        return [(index, beam.tokens) for index, beam in self._asked]

    def advance(self, outputs: list[Any]) -> None:
        """The step's outputs (RequestOutput-like, one per beams() entry, in order)."""
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self.prompts]
        for (index, beam), output in zip(self._asked, outputs, strict=True):
            if output.error is not None:
                raise ConfigError(f"beam search: a step's request failed: {output.error}")
            step_logprobs = output.outputs[0].logprobs[0]
            for token, logprob in step_logprobs.items():
                child = BeamSearchSequence(tokens=beam.tokens + [token], logprobs=beam.logprobs + [step_logprobs],
                                           cum_logprob=beam.cum_logprob + logprob)
                if token in self.eos_token_ids and not self.params.ignore_eos:
                    child.finish_reason, child.stop_reason = "stop", token
                    self._complete[index].append(child)
                else:
                    candidates[index].append(child)
        width = self.params.beam_width
        self._live = [sorted(group, key=self.score, reverse=True)[:width] for group in candidates]
        self.steps = self.params.max_tokens if not any(self._live) else self.steps + 1

    def results(self, decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
        """Each prompt's beam_width best complete or live sequences, best first; decode: their texts."""
        results = []
        for prompt, group, done in zip(self.prompts, self._live, self._complete):
            best = sorted(done + group, key=self.score, reverse=True)[: self.params.beam_width]
            for sequence in best:
                sequence.finish_reason = sequence.finish_reason or "length"
                if decode is not None:
                    generated = sequence.tokens[len(prompt):]
                    if sequence.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                        generated = generated[:-1]
                    sequence.text = decode(generated)
            results.append(BeamSearchOutput(sequences=best))
        return results


def beam_search(generate: Generate, prompts: list[list[int]], params: BeamSearchParams,
                eos_token_ids: frozenset[int], decode: Callable[[list[int]], str] | None = None,
                on_step: Callable[[], None] | None = None) -> list[BeamSearchOutput]:
    """Run every prompt's search together, one generate call a step; decode gives the texts;
    on_step is called after each step (progress bars)."""
    search = BeamSearch(prompts, params, eos_token_ids)
    while beams := search.beams():
        search.advance(generate(beams, search.step_params))
        if on_step is not None:
            on_step()
    return search.results(decode)


async def beam_search_async(generate, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids: frozenset[int],
                            request_id: str, decode: Callable[[list[int]], str] | None = None,
                            cache_salt: str | None = None, priority: int = 0) -> BeamSearchOutput:
    """One prompt's search through an async engine's generate(prompt, params, request_id, priority)
    (AsyncLLM's, ProcessAsyncLLM's): a step's beams run at once, as <request_id>-beam<step>.<i>.
    Cancelled, or when one beam fails, it stops every beam still running (their blocks go back)."""
    search = BeamSearch([prompt_ids], params, eos_token_ids)

    async def final_output(tokens: list[int], beam_id: str):
        prompt = {"prompt_token_ids": tokens, **({"cache_salt": cache_salt} if cache_salt else {})}
        async for delta in generate(prompt, search.step_params, beam_id, priority):
            if delta.finished:
                return delta.output
        raise ConfigError(f"beam search: the stream of {beam_id} ended before its request finished")

    while beams := search.beams():
        tasks = [asyncio.ensure_future(final_output(tokens, f"{request_id}-beam{search.steps}.{i}"))
                 for i, (_, tokens) in enumerate(beams)]
        try:
            outputs = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        search.advance(outputs)
    return search.results(decode)[0]
