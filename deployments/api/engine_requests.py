"""OpenAI requests as engine requests: GenerateRequests whose SamplingParams are built once.

An HTTP request becomes one `Draft` per prompt: the GenerateRequest and the sampling fields the
request set. Tools, reasoning, beam search and the server's limits add to the fields
(tools.py, reasoning.py); `Draft.finish` then builds SamplingParams once, over the served model's
defaults (ModelInfo.sampling_defaults), and a bad value is a ConfigError naming the field.

Defaults: completions generate at most 16 tokens (OpenAI's default); chat without max_tokens runs
to the end of the context, as under OpenAI and vLLM (GenerateRequest.max_tokens_to_context: the API
does not know the prompt's token count; the replica applies the chat template and lowers max_tokens
to what the prompt leaves; the operator's max_output_tokens caps it).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from ponytail import ConfigError, SamplingParams, check_chat_template_options

from .openai_requests import (GUIDED_FIELDS, ChatCompletionRequest, CompletionRequest, ResponseFormat, SamplingRequest,
                              constraint_fields)
from .protocol import BEAM_SEARCH_SAMPLING, GenerateRequest

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Request fields passed to ponytail.SamplingParams under the same name: OpenAI's, then vLLM's extras.
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
                   "stop", "n", "best_of", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
                   "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids", "bad_words")


@dataclass(slots=True)
class Draft:
    """One engine request being built from an HTTP request: the GenerateRequest and the sampling
    fields the request set, by SamplingParams' names (tools.py and reasoning.py add to them)."""

    request: GenerateRequest
    sampling: dict[str, Any]

    def finish(self, defaults: dict[str, Any]) -> GenerateRequest:
        """The request with SamplingParams built from `defaults` (the served model's) under the
        fields set; ConfigError names a bad value."""
        self.request.sampling = SamplingParams(**{**defaults, **self.sampling})
        return self.request


def new_request_id(prefix: str) -> str:
    """OpenAI-style ids: `cmpl-<hex>` for completions, `chatcmpl-<hex>` for chat."""
    return f"{prefix}-{uuid.uuid4().hex}"


def requested_constraint(req: SamplingRequest) -> dict[str, Any] | None:
    """SamplingParams.structured_outputs from the request's own constraint field; ConfigError when
    there are several (the message names the first)."""
    given = constraint_fields(req)
    if len(given) > 1:
        raise ConfigError(f"{given[0]}={_shown(getattr(req, given[0]))} cannot be combined with {given[1]}; "
                          "allowed: one constraint per request")
    if not given:
        return None
    name = given[0]
    if name == "structured_outputs":
        return dict(req.structured_outputs)
    if name == "response_format":
        return response_format_constraint(req.response_format)
    return {GUIDED_FIELDS[name]: getattr(req, name)}


def _shown(value) -> str:
    value = value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value
    return f"{value!r:.60}"


def response_format_constraint(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """structured_outputs for OpenAI's response_format (None for text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ConfigError("response_format={'type': 'json_schema'} has no json_schema.schema; "
                          "allowed: {'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
    return {"json": fmt.json_schema.schema_}


def to_drafts(req: CompletionRequest | ChatCompletionRequest, base_id: str | None = None) -> list[Draft]:
    """One engine request per prompt of a completions request (a string, token ids, or a list of
    either), one for a chat request. Ids: `<prefix>-<base_id>` (base_id: the client's x-request-id,
    else a random hex), with `-<index>` appended when there are several prompts."""
    prefix = "chatcmpl" if isinstance(req, ChatCompletionRequest) else "cmpl"
    request_id = f"{prefix}-{base_id}" if base_id else new_request_id(prefix)
    prompts = [None] if isinstance(req, ChatCompletionRequest) else _prompts(req.prompt)
    if len(prompts) == 1:  # a list of one prompt ([[ids]], what lm-eval sends) is that prompt
        one = prompts[0]
        single = req if one is None or one is req.prompt else req.model_copy(update={"prompt": one})
        return [to_draft(single, request_id)]
    return [to_draft(req.model_copy(update={"prompt": prompt}), f"{request_id}-{index}")
            for index, prompt in enumerate(prompts)]


def _prompts(prompt: str | list) -> list:
    """A completions prompt as a list of single prompts (strings or token-id lists)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    if not prompt:
        raise ConfigError("prompt=[] is empty; allowed: a string, a list of token ids, or a non-empty list of either")
    return list(prompt)


def to_draft(req: CompletionRequest | ChatCompletionRequest, request_id: str | None = None) -> Draft:
    """The engine request for one prompt of an OpenAI request, and the sampling fields it set."""
    sampling = {name: value for name in SAMPLING_FIELDS if (value := getattr(req, name)) is not None}
    if req.prompt_logprobs is not None:
        if req.stream:
            raise ConfigError(f"prompt_logprobs={req.prompt_logprobs} with stream=true is not supported; allowed: "
                              "prompt_logprobs on a request that is not streamed")
        sampling["prompt_logprobs"] = req.prompt_logprobs
    if (constraint := requested_constraint(req)) is not None:
        sampling["structured_outputs"] = constraint
    if req.logit_bias:
        sampling["logit_bias"] = _token_keys(req.logit_bias)
    if req.logprob_token_ids is not None:
        sampling["logprob_token_ids"] = req.logprob_token_ids
    if req.thinking_token_budget is not None:
        sampling["thinking_token_budget"] = req.thinking_token_budget
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is not None:
            sampling["max_tokens"] = max_tokens
        sampling.update(chat_logprob_fields(req))
        messages = [m.to_dict() for m in req.messages]
        kwargs = template_kwargs(req)
        check_chat_template_options(kwargs, req.add_generation_prompt, req.continue_final_message, messages)
        return Draft(GenerateRequest(messages=messages, request_id=request_id or new_request_id("chatcmpl"),
                                     chat_template_kwargs=kwargs,
                                     add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message,
                                     truncate_prompt_tokens=req.truncate_prompt_tokens,
                                     truncation_side=req.truncation_side or "left",
                                     max_tokens_to_context=max_tokens is None, cache_salt=req.cache_salt,
                                     documents=req.documents, prompt_logprobs=req.prompt_logprobs,
                                     priority=req.priority, add_special_tokens=req.add_special_tokens,
                                     return_token_ids=bool(req.return_token_ids)), sampling)
    sampling.setdefault("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    if req.logprob_token_ids is not None and req.logprobs is None:
        raise ConfigError(f"logprob_token_ids={_shown(req.logprob_token_ids)} needs logprobs; allowed: "
                          "logprob_token_ids only together with logprobs (any count: the tracked tokens replace "
                          "the top ones)")
    if req.logprobs is not None:
        if req.logprob_token_ids is None:
            sampling["logprobs"] = req.logprobs
        if req.echo:  # what loglikelihood evaluation reads: the prompt tokens' logprobs
            sampling["prompt_logprobs"] = max(req.logprobs, req.prompt_logprobs or 0)
    return Draft(GenerateRequest(prompt=req.prompt, request_id=request_id or new_request_id("cmpl"),
                                 echo=bool(req.echo), truncate_prompt_tokens=req.truncate_prompt_tokens,
                                 truncation_side=req.truncation_side or "left", cache_salt=req.cache_salt,
                                 prompt_logprobs=req.prompt_logprobs, priority=req.priority,
                                 add_special_tokens=req.add_special_tokens,
                                 return_token_ids=bool(req.return_token_ids)), sampling)


MAX_BEAMS = 10  # ponytail.BeamSearchParams' limit: each beam asks for 2 x n of at most 20 logprobs a step


def set_beam_search(req: CompletionRequest | ChatCompletionRequest, draft: Draft) -> None:
    """The request's beam_search from use_beam_search and length_penalty (once the sampling fields are
    final: tools and response formats add to them); ConfigError names what cannot go with it."""
    if not req.use_beam_search:
        if req.length_penalty is not None and req.length_penalty != 1:
            raise ConfigError(f"length_penalty={req.length_penalty} ranks beams and needs use_beam_search=true; "
                              "allowed without it: 1, or leave it out")
        return
    field = req.field_name if isinstance(req, ChatCompletionRequest) else (lambda name: name)
    others = [name for name in draft.sampling if name not in BEAM_SEARCH_SAMPLING]
    if draft.request.tools:
        others.insert(0, "tools")
    if getattr(req, "echo", False):
        others.insert(0, "echo")
    if req.stream:
        others.insert(0, "stream")
    if others:
        name = others[0]
        value = {"tools": "[...]", "echo": "true", "stream": "true"}.get(name)
        if value is None and field(name) == "logprobs" and isinstance(req, ChatCompletionRequest):
            value = "true"  # chat's logprobs=true alone
        elif value is None:
            name, value = field(name), _shown(draft.sampling[name])
        raise ConfigError(f"{name}={value} cannot be combined with use_beam_search=true; allowed with it: "
                          f"{', '.join(field(name) for name in BEAM_SEARCH_SAMPLING)}, length_penalty")
    beams = draft.sampling.get("n", 1)
    if beams > MAX_BEAMS:
        raise ConfigError(f"n={beams} with use_beam_search=true asks for {beams} beams; allowed: at most {MAX_BEAMS}")
    draft.request.beam_search = {"length_penalty": 1.0 if req.length_penalty is None else float(req.length_penalty)}


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """chat_template_kwargs, with reasoning_effort as vLLM passes it: itself, and enable_thinking
    (false for "none") unless the request set that."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
        kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
    return kwargs or None


def _token_keys(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings."""
    try:
        return {int(key): value for key, value in bias.items()}
    except ValueError:
        raise ConfigError(f"logit_bias={bias!r:.80} is invalid; allowed: token ids (integers) as keys, "
                          "biases in [-100, 100] as values") from None


def chat_logprob_fields(req: ChatCompletionRequest) -> dict[str, int]:
    """SamplingParams.logprobs from chat's logprobs/top_logprobs (OpenAI: top_logprobs needs logprobs)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise ConfigError(f"top_logprobs={req.top_logprobs} needs logprobs=true; allowed: top_logprobs "
                          "only together with logprobs=true")
    if req.logprob_token_ids is not None and not req.logprobs:
        raise ConfigError(f"logprob_token_ids={_shown(req.logprob_token_ids)} needs logprobs=true; allowed: "
                          "logprob_token_ids only together with logprobs=true")
    if not req.logprobs:
        return {}
    if req.logprob_token_ids is not None:  # the tracked tokens replace the top ones (vLLM)
        return {}
    return {"logprobs": 0 if req.top_logprobs is None else req.top_logprobs}
