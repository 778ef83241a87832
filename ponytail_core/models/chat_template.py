"""A conversation as the prompt a chat model runs: its tokenizer's chat template applied with
vLLM's options (`LLM.chat`, and the OpenAI server's chat fields in deployments/prompts.py).

Options: `chat_template_kwargs` (names the template reads, e.g. enable_thinking), `tools`,
`add_generation_prompt` (open the assistant's answer) or `continue_final_message` (continue the
last message as it stands: prefilling the answer). A template that refuses the conversation
(raise_exception) and bad options are ConfigErrors that name the field.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError

# apply_chat_template's own parameters, set from the options: chat_template_kwargs may not replace them
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})


def check_chat_template_options(kwargs: dict[str, Any] | None, add_generation_prompt: bool,
                                continue_final_message: bool, messages: list[dict[str, Any]] | None = None) -> None:
    """The chat template's options as vLLM takes them; ConfigError names the field at fault."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(f"chat_template_kwargs={kwargs!r:.80} is invalid; allowed: an object of names the "
                          "template reads, e.g. {\"enable_thinking\": false}")
    taken = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs or {}))
    if taken:
        raise ConfigError(f"chat_template_kwargs={taken} sets what the server sets itself; allowed: other names "
                          "the template reads (such as enable_thinking), and the request's own fields for these")
    if continue_final_message and add_generation_prompt:
        raise ConfigError("continue_final_message=true needs add_generation_prompt=false; allowed: one of them, "
                          "not both (the answer either continues the last message or starts a new one)")
    if continue_final_message and messages and not _has_text(messages[-1].get("content")):
        raise ConfigError("continue_final_message=true needs a last message with text to continue; allowed: a "
                          "last message (usually the assistant's) whose content is not empty")


def is_chat_template(text: Any) -> bool:
    """Whether `text` reads as a Jinja template (a `{{` or a `{%`), not a path or a name."""
    return isinstance(text, str) and ("{{" in text or "{%" in text)


def _has_text(content: Any) -> bool:
    return isinstance(content, str) and bool(content.strip())


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *, tokenize: bool,
                tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
                chat_template: str | None = None, documents: list[dict[str, str]] | None = None) -> str | list[int]:
    """The template applied: its text, or with tokenize its token ids (the template writes the
    special tokens; none are added). ConfigError for a refused conversation. chat_template: a
    template's text to use instead of the tokenizer's. documents: for templates that take them
    (RAG: Command R, Granite), as transformers passes them."""
    import jinja2

    extra = dict(chat_template_kwargs or {})
    if chat_template is not None:
        if not is_chat_template(chat_template):
            raise ConfigError(f"chat_template={chat_template!r:.60} is not a Jinja template (no '{{{{' or '{{%'); "
                              "allowed: a template's text, or None for the tokenizer's")
        extra["chat_template"] = chat_template
    if tools:  # only when given: tokenizers without tool support keep working
        extra["tools"] = tools
    if documents:
        extra["documents"] = documents
    if continue_final_message:
        extra["continue_final_message"] = True
    try:
        if not tokenize:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False, **extra)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            return_dict=False, **extra)
    except jinja2.TemplateError as exc:
        raise ConfigError(f"messages: the chat template refused them: {exc}; allowed: a conversation the "
                          "model's template accepts (roles, order, fields)") from None
    except ValueError as exc:  # transformers: the final message is not in the rendered chat (continue_final_message)
        if not continue_final_message:
            raise
        raise ConfigError(f"continue_final_message=true: {exc}; allowed: a template that writes the last message "
                          "as sent, or continue_final_message=false") from None
    if hasattr(ids, "input_ids") or isinstance(ids, dict):
        ids = ids["input_ids"]
    return list(ids)
