"""What one engine replica serves besides its engine: the served name, how it streams, and how it
reads chat templates, tool calls and thoughts. The app's arguments take these fields as they are
(AppArgs inherits them), so each is defined and checked once."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ponytail import ConfigError, check_chat_template_options, is_chat_template, is_seconds

from deployments.api.reasoning import REASONING_PARSERS
from deployments.api.tool_parsers import TOOL_CALL_PARSERS

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"  # the embedded default model's name in the API
# The engine defaults a server wants unlike an offline LLM(): a chat's next turn finds its history
# cached (the pool grows within its budget rather than evict prefixes while requests run).
SERVING_ENGINE_DEFAULTS = {"keep_prefix_cache": True}


class ReplicaOptions(BaseModel):
    """A replica's serving options; unknown names are refused, so a typo is an error."""

    model_config = ConfigDict(extra="forbid", validate_default=True, populate_by_name=True)

    served_model_name: str | None = Field(
        None, validation_alias=AliasChoices("served_model_name", "model_id"),  # model_id: its older name
        description="the name clients put in \"model\"; unset: the hub id, the directory's name, "
                    f"or {DEFAULT_SERVED_NAME}")
    stream_interval_s: float = Field(0.05, description="a stream's deltas merged over this long, seconds "
                                     "(first token and end not held)")
    max_deltas_per_s: float | None = Field(1000.0, description="messages all of a replica's streams send per "
                                           "second at most: with more streams open each merges over streams / "
                                           "this (never less than stream_interval_s); null: no bound")
    engine_process: bool | None = Field(None, description="run each replica's engine step loop in a process of its "
                                        "own (vLLM's engine core), so streaming does not slow the steps; unset: on "
                                        "for GPUs")
    generation_config: Literal["auto", "ponytail"] = Field(
        "auto", description="auto: requests that leave temperature, top_p, top_k, min_p or repetition_penalty "
                            "unset get the model's generation_config.json values (vLLM's default); ponytail: "
                            "SamplingParams' own defaults")
    chat_template: str | None = Field(None, description="a Jinja chat template, or the path of a file holding one, "
                                      "served instead of the tokenizer's (vLLM's --chat-template); a file is read "
                                      "where the app is built, so replicas on other nodes need no copy")
    tool_call_parser: Literal[TOOL_CALL_PARSERS] = Field(
        "auto", description="how tool_choice auto reads calls from the model's text (vLLM's --tool-call-parser): "
                            "auto finds the format from the chat template (hermes, glm45, llama3_json, mistral, "
                            "or none: auto refused); hermes also reads qwen3_coder's XML, glm45 glm47's; pythonic "
                            "only when set; none reads no calls")
    reasoning_parser: Literal[REASONING_PARSERS] = Field(
        "auto", description="how a reasoning model's thought is split from its answer into the response's "
                            "`reasoning` (vLLM's --reasoning-parser): auto (templates with </think>), qwen3, "
                            "deepseek_r1 (vLLM's rules), none (the thought stays in the content)")
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="names every chat request's template gets unless the request sets them (vLLM's "
                          "--default-chat-template-kwargs), e.g. {\"enable_thinking\": false}; a JSON object as a flag")
    max_prompt_tokens: int | None = Field(None, description="longest prompt in tokens; unset: the context "
                                          "(max_model_len)")

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: str | None) -> str | None:
        """The template's text: a path is read here, on the machine that builds the app."""
        if value is None or is_chat_template(value):
            return value
        path = os.path.expanduser(value)
        if not os.path.isfile(path):
            raise ValueError(f"chat_template={value!r} is neither a file here nor a Jinja template (no '{{{{' or "
                             "'{%'); allowed: a template's text or the path of a file holding one")
        with open(path, encoding="utf-8") as file:
            text = file.read()
        if not is_chat_template(text):
            raise ValueError(f"chat_template={value!r}: the file holds no Jinja template (no '{{{{' or '{{%'); "
                             "allowed: a template's text or the path of a file holding one")
        return text

    @field_validator("default_chat_template_kwargs", mode="before")
    @classmethod
    def _template_defaults(cls, value):
        """A JSON object (a flag gives its text); names apply_chat_template sets itself are refused."""
        value = from_json("default_chat_template_kwargs", value, '{"enable_thinking": false}')
        if value is not None:
            try:
                check_chat_template_options(value, True, False)
            except ConfigError as exc:
                raise ValueError(str(exc).replace("chat_template_kwargs", "default_chat_template_kwargs", 1)) from None
        return value or None

    @field_validator("engine_process", mode="before")
    @classmethod
    def _engine_process(cls, value: object, info: ValidationInfo) -> object:
        return on_off_or_auto(value, info.field_name)

    @field_validator("stream_interval_s")
    @classmethod
    def _stream_interval(cls, value: float) -> float:
        if not is_seconds(value, most=1):
            raise ValueError(f"stream_interval_s={value:g} is not supported; allowed: seconds from 0 to 1 "
                             "(0: a message per engine step)")
        return value

    @field_validator("max_deltas_per_s")
    @classmethod
    def _max_deltas(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"max_deltas_per_s={value:g} is not supported; allowed: a number > 0, or null (no bound)")
        return value

    @field_validator("max_prompt_tokens")
    @classmethod
    def _max_prompt_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"max_prompt_tokens={value} is not supported; allowed: an integer >= 1 or null "
                             "(the context)")
        return value


def replica_options(**options: Any) -> ReplicaOptions:
    """ReplicaOptions, a bad value a ConfigError naming the field, the value and what is allowed."""
    try:
        return ReplicaOptions(**options)
    except ValidationError as exc:
        raise ConfigError("; ".join(_described(error) for error in exc.errors(include_url=False))) from None


def _described(error: dict) -> str:
    name = ".".join(str(part) for part in error["loc"])
    if error["type"] == "literal_error":
        allowed = error["ctx"]["expected"].replace("'", "").replace(" or ", ", ")
        return f"{name}={error['input']!r} is not supported; allowed: {allowed}"
    if error["type"] == "value_error":  # our own checks name the field, the value and what is allowed
        return error["msg"].removeprefix("Value error, ")
    return f"{name}={error['input']!r:.60}: {error['msg']}"


def from_json(name: str, value: Any, example: str) -> Any:
    """A JSON object's text (a command-line flag's, a `serve run key=value`'s) as the object; any
    other value as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise ValueError(f"{name}={value!r:.80} is not JSON ({exc}); allowed: a JSON object such as "
                         f"'{example}'") from None


def on_off_or_auto(value: object, name: str) -> object:
    """true, false or null as written: pydantic would take "yes" or 1 as true ("true" from the
    command line stays a boolean, as pydantic reads it)."""
    if value is None or isinstance(value, bool) or str(value).lower() in ("true", "false"):
        return value
    if str(value).lower() in ("null", "none"):
        return None
    raise ValueError(f"{name}={value!r} is not supported; allowed: true, false, null (unset: the default)")


def served_name(model: str | None, served_model_name: str | None) -> str:
    """What clients put in "model": the name given, else a hub id whole (clients load its tokenizer by
    it), a local directory's name, or the default model's."""
    if served_model_name:
        return served_model_name
    if model is None:
        return DEFAULT_SERVED_NAME
    if os.path.exists(os.path.expanduser(model)):
        return os.path.basename(model.rstrip("/"))
    return model
