"""A GenerateRequest's prompt as the token ids the engine will run: one function for the replica
and the prefix-aware router, so the router hashes exactly the blocks the engine caches."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from ponytail import render_chat

from .protocol import GenerateRequest
from .segment_tokens import SegmentCache


def use_chat_template(tokenizer: Any, template: str | None) -> None:
    """Serve `template` (the app's chat_template) instead of the tokenizer's own; a template that does
    not compile is a ConfigError at start-up, not a 500 on every chat request."""
    if template is None:
        return
    import jinja2
    from ponytail import ConfigError

    if tokenizer is None:
        raise ConfigError("chat_template is set, but the model has no tokenizer to apply it with; allowed: "
                          "a model with a tokenizer, or no chat_template")
    tokenizer.chat_template = template
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                      tokenize=False)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"chat_template does not compile: line {exc.lineno}: {exc.message}; allowed: a Jinja "
                          "chat template (its text, or the path of a file holding one)") from None
    except jinja2.TemplateError:  # compiles; it refuses this one conversation (raise_exception), as templates may
        pass


def with_template_defaults(request: GenerateRequest, defaults: dict[str, Any] | None) -> GenerateRequest:
    """The request with the operator's default chat_template_kwargs under its own (vLLM's
    --default-chat-template-kwargs): the request's names win. The same request when there are none."""
    if not defaults or request.messages is None:
        return request
    return dataclasses.replace(request, chat_template_kwargs={**defaults, **(request.chat_template_kwargs or {})})


def chat_token_ids(tokenizer: Any, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None = None, segments: SegmentCache | None = None,
                   request: GenerateRequest | None = None) -> list[int]:
    """The chat template applied (with the generation prompt and the tool definitions, unless the
    request's options say otherwise: ponytail.chat_template), as token ids; with `segments` (this
    tokenizer's), the pieces between special tokens seen lately are not tokenized again."""
    options = {} if request is None else {
        "chat_template_kwargs": request.chat_template_kwargs, "add_generation_prompt": request.add_generation_prompt,
        "continue_final_message": request.continue_final_message, "documents": request.documents}
    if request is not None and request.add_special_tokens:  # vLLM's: BOS... on top of what the template writes
        text = render_chat(tokenizer, messages, tokenize=False, tools=tools, **options)
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if segments is not None and segments.usable:  # what apply_chat_template(tokenize=True) tokenizes, in pieces
        return segments.encode(render_chat(tokenizer, messages, tokenize=False, tools=tools, **options))
    return render_chat(tokenizer, messages, tokenize=True, tools=tools, **options)


def prompt_token_ids(tokenizer: Any, request: GenerateRequest, segments: SegmentCache | None = None) -> list[int]:
    """Token ids of the request's prompt: chat messages through the template, text as the engine
    tokenizes it (special tokens added unless the request says add_special_tokens=false), token ids
    as given."""
    if request.messages is not None:
        return chat_token_ids(tokenizer, request.messages, request.tools, segments, request)
    if isinstance(request.prompt, list):
        return list(request.prompt)
    return list(tokenizer(request.prompt, add_special_tokens=request.add_special_tokens is not False)["input_ids"])


def truncated(token_ids: list[int], keep: int, side: str = "left") -> list[int]:
    """vLLM's truncate_prompt_tokens (keep > 0) as its truncation_side says: the last `keep` ids
    ("left", the default), or the first ("right"). The replica runs these; the router hashes them."""
    return token_ids[:keep] if side == "right" else token_ids[-keep:]


def tokenizer_fingerprint(tokenizer: Any, template_defaults: dict[str, Any] | None = None) -> str | None:
    """A digest of everything that decides a prompt's token ids (the fast tokenizer's whole
    definition, the chat template, the special tokens): two processes whose tokenizers share it
    tokenize every prompt alike, so one may take the other's ids. None without a fast tokenizer.
    ~60 ms for SmolLM2's (a 1.5 MB definition): computed once per process."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        definition = backend.to_str() if backend is not None else None
    except Exception:  # a tokenizer that cannot say what it is: its ids are never shared
        return None
    if definition is None:
        return None
    digest = hashlib.sha256(definition.encode())
    for part in (type(tokenizer).__name__, getattr(tokenizer, "chat_template", None),
                 getattr(tokenizer, "special_tokens_map", None), getattr(tokenizer, "add_bos_token", None)):
        digest.update(repr(part).encode())
    if template_defaults:  # they change what a chat renders to
        digest.update(repr(sorted(template_defaults.items())).encode())
    return digest.hexdigest()
