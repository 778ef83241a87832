"""The operator's chat_template (served instead of the tokenizer's, vLLM's --chat-template) and
tool_call_parser (how tool_choice "auto" reads calls, vLLM's --tool-call-parser): from the app's
args to the replica, its served tool-call format and the prefix router's tokenizer."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve")

import ponytail  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from deployments.app.args import AppArgs

from deployments.app.builder import engine_arguments, router_arguments  # noqa: E402
from deployments.api.prompts import chat_token_ids, tokenizer_fingerprint  # noqa: E402
from deployments.api.protocol import GenerateRequest  # noqa: E402
from ponytail import SamplingParams  # noqa: E402
from deployments.app.replica import EngineReplica  # noqa: E402
from deployments.api.tool_parsers import HERMES, LLAMA3_JSON, served_tool_call_format  # noqa: E402

# A Hermes-style template: the tools in a system turn, calls as <tool_call> blocks.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}\nCall one as <tool_call>{...}</tool_call>"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}<|python_tag|>"
MESSAGES = [{"role": "user", "content": "Capital of France?"}]


def test_a_template_is_kept_as_text_and_a_path_is_read_where_the_app_is_built(tmp_path):
    assert AppArgs(chat_template=HERMES_TEMPLATE).chat_template == HERMES_TEMPLATE
    file = tmp_path / "hermes.jinja"
    file.write_text(HERMES_TEMPLATE)
    args = AppArgs(chat_template=str(file))
    assert args.chat_template == HERMES_TEMPLATE  # the text travels to replicas on other nodes
    assert engine_arguments(args, gpu=False)["chat_template"] == HERMES_TEMPLATE
    assert router_arguments(AppArgs(router="prefix", chat_template=str(file)))["chat_template"] == HERMES_TEMPLATE
    assert AppArgs().chat_template is None and engine_arguments(AppArgs(), gpu=False)["tool_call_parser"] == "auto"


def test_a_template_that_is_neither_a_file_nor_jinja_is_refused_by_name(tmp_path):
    missing = str(tmp_path / "nowhere.jinja")
    with pytest.raises(ValidationError, match=r"chat_template='.*nowhere.jinja' is neither a file here nor a Jinja "
                                              r"template .*allowed: a template's text or the path"):
        AppArgs(chat_template=missing)
    plain = tmp_path / "plain.txt"
    plain.write_text("just words")
    with pytest.raises(ValidationError, match="the file holds no Jinja template"):
        AppArgs(chat_template=str(plain))
    with pytest.raises(ValidationError, match="tool_call_parser"):
        AppArgs(tool_call_parser="xml")


def test_the_parser_setting_decides_the_served_format():
    assert served_tool_call_format("auto", HERMES_TEMPLATE) == HERMES
    assert served_tool_call_format("auto", LLAMA3_TEMPLATE) == LLAMA3_JSON
    assert served_tool_call_format("auto", "{{ messages }}") is None
    assert served_tool_call_format("none", HERMES_TEMPLATE) is None  # the operator reads no calls
    assert served_tool_call_format(LLAMA3_JSON, HERMES_TEMPLATE) == LLAMA3_JSON  # forced, whatever the template
    assert AppArgs(tool_call_parser="mistral").tool_call_parser == "mistral"
    assert served_tool_call_format("pythonic", HERMES_TEMPLATE) == "pythonic"  # only ever set, never found
    assert served_tool_call_format("qwen3_coder", None) == HERMES  # vLLM's name: the same blocks, XML bodies
    assert AppArgs(tool_call_parser="qwen3_coder").tool_call_parser == "qwen3_coder"
    with pytest.raises(ValueError, match="tool_call_parser='xml' is not supported; allowed: auto, hermes"):
        served_tool_call_format("xml", None)


def test_a_replica_refuses_an_unknown_parser_before_loading():
    with pytest.raises(ponytail.ConfigError, match="tool_call_parser='xml' is not supported; allowed: auto, hermes, "
                                                   "qwen3_coder, llama3_json, mistral, pythonic, glm45, glm47, none"):
        EngineReplica(engine={"device": "cpu"}, tool_call_parser="xml")
    with pytest.raises(ponytail.ConfigError, match="reasoning_parser='o1' is not supported; allowed: auto, "
                                                   "deepseek_r1, qwen3, none"):
        EngineReplica(engine={"device": "cpu"}, reasoning_parser="o1")
    with pytest.raises(ponytail.ConfigError, match=r"chat_template_kwargs=\['messages'\] sets what the server"):
        EngineReplica(engine={"device": "cpu"}, default_chat_template_kwargs={"messages": []})


def _replica(**kwargs) -> EngineReplica:
    return EngineReplica(engine=dict(device="cpu", kv_cache_memory="16MiB", max_num_seqs=2, max_model_len=256), **kwargs)


@pytest.mark.network  # the default model
def test_a_replica_serves_the_operators_template_and_reads_its_format(default_model):
    replica = _replica(chat_template=HERMES_TEMPLATE)
    assert replica.tokenizer.chat_template == HERMES_TEMPLATE
    assert replica.info.tool_call_format == HERMES  # found from the served template, not the model's own
    expected = chat_token_ids(replica.tokenizer, MESSAGES)
    assert replica.tokenizer.decode(expected).startswith("<|im_start|>user\nCapital of France?")
    request = GenerateRequest(messages=MESSAGES, sampling=SamplingParams(max_tokens=1, temperature=0), request_id="tpl")

    async def main():
        return [d async for d in replica.generate(request)]

    assert asyncio.run(main())[-1].prompt_tokens == len(expected)  # SmolLM2's own template adds a system turn
    forced = _replica(tool_call_parser="llama3_json")  # the model's own template shows no format
    assert forced.info.tool_call_format == LLAMA3_JSON and forced.tokenizer.chat_template != HERMES_TEMPLATE
    assert _replica(chat_template=HERMES_TEMPLATE, tool_call_parser="none").info.tool_call_format is None


@pytest.mark.network
def test_a_template_that_does_not_compile_stops_the_replica_with_its_line(default_model):
    with pytest.raises(ponytail.ConfigError, match=r"chat_template does not compile: line 1: .*allowed: a Jinja"):
        _replica(chat_template="{% for m in messages %}{{ m.content }}")


@pytest.mark.network
def test_the_prefix_router_tokenizes_with_the_served_template(default_model):
    from test_prefix_routing import make_router
    from test_router import FakeClock

    replica = _replica(chat_template=HERMES_TEMPLATE)
    router = make_router(FakeClock(), tokenizer=ponytail.load_tokenizer(None), chat_template=HERMES_TEMPLATE)
    # The same fingerprint: the replica runs the router's ids instead of tokenizing again.
    assert tokenizer_fingerprint(router.tokenizer) == tokenizer_fingerprint(replica.tokenizer)
    assert chat_token_ids(router.tokenizer, MESSAGES) == chat_token_ids(replica.tokenizer, MESSAGES)


def test_a_template_for_a_model_without_a_tokenizer_is_refused_by_name():
    from deployments.api.prompts import use_chat_template

    with pytest.raises(ponytail.ConfigError, match="chat_template is set, but the model has no tokenizer to apply it "
                                                   "with; allowed: a model with a tokenizer, or no chat_template"):
        use_chat_template(None, HERMES_TEMPLATE)
    use_chat_template(None, None)  # nothing asked, nothing to check
