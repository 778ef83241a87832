"""What the API and other Ray apps send to an engine replica, and what comes back.

Plain dataclasses: they cross Ray handles (pickled) and carry no Ray or FastAPI types. A request's
sampling is a ponytail.SamplingParams, checked where the request is made (the API builds it once,
over the served model's defaults: ModelInfo.sampling_params); the replica and the router read its
fields as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ponytail import ConfigError, SamplingParams


# What a beam search takes from sampling (vLLM's BeamSearchParams); any other field is refused with it.
BEAM_SEARCH_SAMPLING = ("n", "max_tokens", "temperature", "ignore_eos", "include_stop_str_in_output",
                        "skip_special_tokens")


@dataclass(slots=True)
class GenerateRequest:
    prompt: str | list[int] | None = None  # text or token ids (completions)
    messages: list[dict[str, Any]] | None = None  # chat messages; the replica applies the chat template
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions, for the chat template
    documents: list[dict[str, str]] | None = None  # vLLM's: for templates that take them (RAG)
    # The chat template's options (vLLM's request fields): names it reads (enable_thinking, ...),
    # whether to open the assistant's answer, or to continue the last message as it stands.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    truncate_prompt_tokens: int | None = None  # run only the prompt's last this many tokens (-1: what fits)
    truncation_side: str = "left"  # vLLM's: "right" keeps the prompt's first truncate_prompt_tokens instead
    cache_salt: str | None = None  # only requests with the same salt share cached prefix blocks (vLLM's)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field: each choice's first delta carries them
    priority: int = 0  # vLLM's: lower runs first where the engine's scheduling_policy is "priority"
    request_id: str | None = None
    echo: bool = False  # the first delta carries the prompt's text (and its logprobs if asked for)
    # vLLM's: the tokenizer's special tokens (BOS...) added to the prompt's text; None: the endpoint's
    # default, yes for a text prompt, no for chat (its template writes them)
    add_special_tokens: bool | None = None
    return_token_ids: bool = False  # vLLM's: each choice's first delta carries the prompt's token ids
    # (tokenizer fingerprint, token ids) of the messages or text, set by the prefix router, which
    # tokenized them to hash their blocks: a replica whose tokenizer has that fingerprint
    # (prompts.tokenizer_fingerprint) takes the ids instead of tokenizing the prompt a second time.
    tokenized: tuple[str, list[int]] | None = None
    # Set by the API where it splits a reasoning model's answer (reasoning.py): the replica counts
    # the tokens of the thought for usage, the answer starting in it (True), or in it only if it
    # begins with `<think>` (None), or not (False).
    count_reasoning: bool = False
    starts_in_thought: bool | None = None
    # The request set no max_tokens and runs to the end of the context (OpenAI's and vLLM's chat
    # default): the replica lowers sampling.max_tokens (the bound: the context, or the operator's
    # max_output_tokens) to what the prompt leaves of the context.
    max_tokens_to_context: bool = False
    # vLLM's use_beam_search: sampling's n beams, its max_tokens, temperature, ignore_eos and
    # include_stop_str_in_output; this holds the rest ({"length_penalty": ...}); None: no beam search.
    beam_search: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise ConfigError(f"sampling={self.sampling!r:.60} is not supported; allowed: a ponytail.SamplingParams "
                              "(ModelInfo.sampling_params builds one over the served model's defaults)")

    def num_prompt_tokens_hint(self) -> int:
        """A cheap upper-bound guess of prompt tokens for routing, before tokenizing."""
        if isinstance(self.prompt, list):
            return len(self.prompt)
        text = self.prompt if isinstance(self.prompt, str) else " ".join(
            str(m.get("content", "")) for m in (self.messages or []))
        return len(text) // 3 + 16  # ~3 characters per token, plus template overhead


@dataclass(slots=True)
class TokenLogprob:
    """One token's logprob and the most likely alternatives, with their text (the replica decodes)."""

    token_id: int
    token: str  # the token decoded on its own
    logprob: float | None  # None only for a prompt's first token, which nothing predicts
    top: list[tuple[int, str, float]]  # (token id, text, logprob), most likely first; as many as asked


@dataclass(slots=True)
class GenerateDelta:
    """What one choice of a request produced since its previous delta. A request with n > 1 streams
    its choices' deltas interleaved, each with its `index`; `finished` marks the request's last."""

    request_id: str
    text: str  # new text of choice `index` since its previous delta
    token_ids: list[int]  # new token ids since the previous delta
    finished: bool  # the whole request is over: its last delta
    finish_reason: str | None  # "stop", "length", "abort", "error" once choice `index` finished
    prompt_tokens: int
    completion_tokens: int  # of choice `index`, so far
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked
    prompt_text: str | None = None  # echo: the prompt as text, in each choice's first delta only
    prompt_logprobs: list[TokenLogprob] | None = None  # echo + prompt_logprobs: each choice's first delta only
    # The request's prompt_logprobs field, in vLLM's JSON shape (logprobs.prompt_logprob_entries): the
    # request's first delta only
    prompt_logprob_entries: list[dict[str, dict[str, Any]] | None] | None = None
    index: int = 0  # the choice (0 .. n - 1)
    cached_tokens: int = 0  # of prompt_tokens, those the prefix cache held (computed once, not again)
    reasoning_tokens: int | None = None  # of completion_tokens, those in the thought (count_reasoning only)
    stop_reason: int | str | None = None  # with finish_reason "stop": the stop string or token id (None: EOS)
    prompt_token_ids: list[int] | None = None  # return_token_ids: the prompt's, in each choice's first delta


@dataclass(slots=True)
class ModelInfo:
    model_id: str  # the served name: first in /v1/models (what clients that load a tokenizer by it read)
    max_model_len: int
    block_size: int
    device: str
    device_uuid: str | None  # the GPU this replica owns (None on CPU)
    root: str | None = None  # where the tokenizer loads from (a local path or hub id), for clients
    aliases: list[str] = field(default_factory=list)  # other names requests may use (listed after model_id)
    tool_call_format: str | None = None  # how the chat template writes tool calls (tool_parsers.py); None: no format
    reasoning_format: str | None = None  # how answers split into thought and content (reasoning.py); None: no split
    chat_template_kwargs: dict[str, Any] | None = None  # the operator's defaults, under each request's own
    # reasoning_format "think": whether the generation prompt leaves a <think> open, with
    # enable_thinking unset, true, false (reasoning.thought_opens)
    thought_opens: tuple[bool, bool, bool] | None = None
    scheduling_policy: str = "fcfs"  # the engine's (vLLM's): "priority" takes requests' priority
    # The sampling fields a request leaves unset take these: the model's generation_config.json
    # values (temperature, top_p, ...) where the replica serves them (generation_config: auto).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def serves(self, name: str) -> bool:
        return name == self.model_id or name in self.aliases

    def sampling_params(self, **fields: Any) -> SamplingParams:
        """SamplingParams of `fields` over the served model's defaults, as the API builds them."""
        return SamplingParams(**{**self.sampling_defaults, **fields})
