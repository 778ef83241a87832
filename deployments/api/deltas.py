"""An engine's outputs as the GenerateDeltas a request streams: text, token ids, finish and stop
reasons, logprobs with their text, reasoning tokens for usage, and what the answer says of its
prompt (echo, prompt logprobs, prompt token ids) on each choice's first delta."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ponytail import RequestDelta, RequestOutput, SamplingParams, TokenTexts

from .logprobs import prompt_logprob_entries, shown_top, token_logprobs
from .protocol import GenerateDelta, GenerateRequest, TokenLogprob
from .reasoning import ReasoningTokens


@dataclass(slots=True, frozen=True)
class PromptSaid:
    """What a request's answer says of its prompt, once per request."""

    text: str | None  # echo: the prompt's text, which every choice's text starts with
    logprobs: list[TokenLogprob] | None  # echo with logprobs: the prompt tokens', in every choice's logprobs
    entries: list | None  # the prompt_logprobs field, in vLLM's shape (logprobs.prompt_logprob_entries)
    token_ids: list[int] | None = None  # return_token_ids: the prompt's, in every choice's first delta


class DeltaWriter:
    """One request's deltas as the engine streams them (several choices interleaved, by index)."""

    def __init__(self, request: GenerateRequest, texts: TokenTexts, tokenizer: Any):
        self.request, self.texts, self.tokenizer = request, texts, tokenizer
        self.params = request.sampling
        self.started: set[int] = set()  # choices whose first delta went out
        self.said: PromptSaid | None = None  # the same for all choices, made once
        self.sent: dict[int, int] = {}  # per choice: output tokens whose logprobs went out
        self.thoughts: dict[int, ReasoningTokens] = {}  # per choice, where the API splits reasoning

    def write(self, delta: RequestDelta) -> GenerateDelta:
        output = delta.output
        choice = output.outputs[delta.index]
        out = _delta(delta.request_id, output, delta.index, delta.delta_text, delta.new_token_ids, delta.finished)
        request = self.request
        if request.count_reasoning:
            if delta.index not in self.thoughts:
                self.thoughts[delta.index] = ReasoningTokens(request.starts_in_thought, self.texts)
            out.reasoning_tokens = self.thoughts[delta.index].feed(delta.new_token_ids)
        if delta.index not in self.started:  # a choice's first delta carries what is said of the prompt
            if self.said is None:
                self.said = prompt_said(output, request, self.texts, self.tokenizer)
                out.prompt_logprob_entries = self.said.entries  # the API reads them off the request's first delta
            self.started.add(delta.index)
            said = self.said
            out.prompt_text, out.prompt_logprobs, out.prompt_token_ids = said.text, said.logprobs, said.token_ids
        if self.params.logprobs is not None and choice.logprobs is not None:
            done = self.sent.get(delta.index, 0)
            entries = choice.logprobs[done : done + len(delta.new_token_ids)]
            out.logprobs = token_logprobs(self.texts, delta.new_token_ids, entries, shown_top(self.params))
            self.sent[delta.index] = done + len(entries)
        return out

    def whole(self, delta: RequestDelta) -> list[GenerateDelta]:
        """best_of: one whole delta per returned choice, the last one finishing the request."""
        request, params, output = self.request, self.params, delta.output
        said = prompt_said(output, request, self.texts, self.tokenizer)
        outs = []
        for i, choice in enumerate(output.outputs):
            out = _delta(delta.request_id, output, i, choice.text, list(choice.token_ids), i == len(output.outputs) - 1)
            if request.count_reasoning:
                out.reasoning_tokens = ReasoningTokens(request.starts_in_thought, self.texts).feed(out.token_ids)
            out.prompt_text, out.prompt_logprobs, out.prompt_token_ids = said.text, said.logprobs, said.token_ids
            out.prompt_logprob_entries = said.entries if i == 0 else None
            if params.logprobs is not None and choice.logprobs is not None:
                out.logprobs = token_logprobs(self.texts, out.token_ids, choice.logprobs, shown_top(params))
            outs.append(out)
        return outs

    def beams(self, prompt: list[int], sequences: list) -> list[GenerateDelta]:
        """use_beam_search: one whole delta per returned sequence, best first, the last one finishing."""
        request = self.request
        outs = []
        for index, sequence in enumerate(sequences):
            token_ids = sequence.tokens[len(prompt):]
            out = GenerateDelta(request_id=request.request_id, text=sequence.text or "", token_ids=token_ids,
                                finished=index == len(sequences) - 1, finish_reason=sequence.finish_reason,
                                prompt_tokens=len(prompt), completion_tokens=len(token_ids), index=index,
                                prompt_token_ids=list(prompt) if request.return_token_ids else None)
            if request.count_reasoning:
                out.reasoning_tokens = ReasoningTokens(request.starts_in_thought, self.texts).feed(token_ids)
            outs.append(out)  # stop_reason stays None: a beam stops on EOS only
        return outs


def _delta(request_id: str, output: RequestOutput, index: int, text: str, token_ids: list[int],
           finished: bool) -> GenerateDelta:
    choice = output.outputs[index]
    return GenerateDelta(request_id=request_id, text=text, token_ids=token_ids, finished=finished,
                         finish_reason=choice.finish_reason, prompt_tokens=len(output.prompt_token_ids),
                         completion_tokens=len(choice.token_ids), error=output.error, index=index,
                         stop_reason=choice.stop_reason, cached_tokens=output.metrics.num_cached_prompt_tokens)


def prompt_said(output: RequestOutput, request: GenerateRequest, texts: TokenTexts, tokenizer: Any) -> PromptSaid:
    """What a request's answer says of its prompt: with echo its text, and its logprobs when the
    request asked for logprobs; with the prompt_logprobs field, those in vLLM's shape."""
    params: SamplingParams = request.sampling
    ids, scored = output.prompt_token_ids, output.prompt_logprobs
    entries = (prompt_logprob_entries(texts, ids, scored, request.prompt_logprobs)
               if request.prompt_logprobs is not None and scored is not None else None)
    token_ids = list(ids) if request.return_token_ids else None
    if not request.echo:
        return PromptSaid(None, None, entries, token_ids)
    text = output.prompt if output.prompt is not None else tokenizer.decode(ids)
    logprobs = (token_logprobs(texts, ids, scored, shown_top(params))
                if params.logprobs is not None and scored is not None else None)  # echo with logprobs
    return PromptSaid(text, logprobs, entries, token_ids)
