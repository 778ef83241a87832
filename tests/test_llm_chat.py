"""LLM.chat (vLLM's): a conversation through the tokenizer's chat template, then generate."""

import copy

import pytest

import ponytail
from ponytail import ConfigError, SamplingParams

pytestmark = pytest.mark.network  # the default model
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def llm(default_model):
    model, tokenizer = default_model
    return ponytail.LLM(model, tokenizer=copy.deepcopy(tokenizer), kv_cache_memory="32MiB", max_num_seqs=4,
                        max_model_len=512)


def test_chat_runs_what_the_template_renders(llm):
    ids = llm.tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=False)
    (chat,) = llm.chat(ASK, GREEDY)
    (plain,) = llm.generate([list(ids)], GREEDY)
    assert chat.prompt_token_ids == list(ids) and chat.outputs[0].token_ids == plain.outputs[0].token_ids
    assert chat.outputs[0].text.strip()
    second = [{"role": "user", "content": "Name a colour."}]
    both = llm.chat([ASK, second], [GREEDY, GREEDY])
    assert [o.outputs[0].text for o in both][0] == chat.outputs[0].text and len(both) == 2
    assert llm.stats().used_blocks == 0


def test_options_reach_the_template(llm):
    llm.tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if tools %}[{{ tools | length }} tools]{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is false %}<think></think>{% endif %}{% endif %}")
    decode = llm.tokenizer.decode
    (off,) = llm.chat(ASK, GREEDY, chat_template_kwargs={"enable_thinking": False})
    assert decode(off.prompt_token_ids).endswith("assistant\n<think></think>")
    (tools,) = llm.chat(ASK, GREEDY, tools=[{"type": "function", "function": {"name": "f"}}])
    assert "[1 tools]" in decode(tools.prompt_token_ids)
    prefilled = ASK + [{"role": "assistant", "content": "The capital of France is"}]
    (cont,) = llm.chat(prefilled, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert decode(cont.prompt_token_ids).endswith("assistant\nThe capital of France is")


def test_a_chat_template_given_replaces_the_tokenizers_for_that_call(llm):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    (given,) = llm.chat(ASK, GREEDY, chat_template=template)
    assert llm.tokenizer.decode(given.prompt_token_ids) == "[user] What is the capital of France?\n[assistant] "
    (default,) = llm.chat(ASK, GREEDY)
    assert default.prompt_token_ids != given.prompt_token_ids


@pytest.mark.parametrize("kwargs, words", [
    (dict(continue_final_message=True), "continue_final_message=true needs add_generation_prompt=false"),
    (dict(chat_template_kwargs={"tokenize": False}), "chat_template_kwargs=['tokenize'] sets what"),
    (dict(chat_template="templates/chatml.jinja"), "chat_template='templates/chatml.jinja' is not a Jinja template"),
])
def test_bad_options_are_config_errors_naming_them(llm, kwargs, words):
    with pytest.raises(ConfigError) as caught:
        llm.chat(ASK, GREEDY, **kwargs)
    assert words in str(caught.value)


def test_a_model_without_a_tokenizer_is_told_to_send_token_ids(tiny_model):
    model, _ = tiny_model
    llm = ponytail.LLM(model, kv_cache_memory="8MiB", max_num_seqs=2, max_model_len=128)
    with pytest.raises(ConfigError, match="this model has no tokenizer; allowed: a model with a tokenizer, or "
                                          "generate\\(\\) with token ids"):
        llm.chat(ASK)
