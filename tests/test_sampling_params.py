"""SamplingParams: vLLM defaults, normalization, `greedy`, and every validation message."""

import re

import numpy as np
import pytest

from ponytail.errors import ConfigError
from ponytail.sampling.params import SamplingParams


def error(**kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        SamplingParams(**kwargs)
    return str(err.value)


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (
        1, 16, 0, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.logprobs) == (None, [], [], None)
    assert (p.ignore_eos, p.include_stop_str_in_output, p.skip_special_tokens, p.detokenize) == (
        False, False, True, True)
    assert not p.greedy


def test_normalization():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=(np.int64(7), 2)).stop_token_ids == [7, 2]
    assert SamplingParams(top_k=-1).top_k == 0
    p = SamplingParams(temperature=1, top_p=1, max_tokens=np.int32(5), seed=2**64 - 1)
    assert isinstance(p.temperature, float) and isinstance(p.max_tokens, int)
    assert SamplingParams(min_tokens=16).min_tokens == 16  # == max_tokens is allowed
    for edge in (dict(presence_penalty=-2), dict(frequency_penalty=2), dict(min_p=1),
                 dict(logprobs=0), dict(logprobs=20), dict(seed=-(2**63)), dict(top_p=1e-9)):
        SamplingParams(**edge)


def test_greedy():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy  # below vLLM's 1e-5, as vLLM
    assert SamplingParams(top_k=1, temperature=0.7).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert not SamplingParams(top_k=2).greedy


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=129), "n=129 is invalid; allowed: an integer in [1, 128]"),
    (dict(n=True), "n=True (bool) is invalid; allowed: an integer in [1, 128]"),
    (dict(best_of=0), "best_of=0 is invalid; allowed: None or an integer in [n=1, 128]"),
    (dict(max_tokens=0), "max_tokens=0 is invalid; allowed: an integer >= 1"),
    (dict(max_tokens=8.0), "max_tokens=8.0 (float) is invalid; allowed: an integer >= 1"),
    (dict(max_tokens=None), "max_tokens=None (NoneType) is invalid; allowed: an integer >= 1"),
    (dict(min_tokens=-1), "min_tokens=-1 is invalid; allowed: an integer >= 0"),
    (dict(min_tokens=17), "min_tokens=17 is invalid; allowed: an integer <= max_tokens=16"),
    (dict(temperature=-0.5), "temperature=-0.5 is invalid; allowed: >= 0 (0 means greedy)"),
    (dict(temperature="0.7"),
     "temperature='0.7' (str) is invalid; allowed: >= 0 (0 means greedy)"),
    (dict(temperature=True), "temperature=True (bool) is invalid; allowed: >= 0"),
    (dict(temperature=float("inf")),
     "temperature=inf is invalid; allowed: >= 0 (0 means greedy), finite"),
    (dict(temperature=float("nan")), "temperature=nan is invalid; allowed: >= 0"),
    (dict(top_p=0), "top_p=0 is invalid; allowed: 0 < top_p <= 1"),
    (dict(top_p=1.5), "top_p=1.5 is invalid; allowed: 0 < top_p <= 1"),
    (dict(top_p=None), "top_p=None (NoneType) is invalid; allowed: 0 < top_p <= 1"),
    (dict(top_k=-2), "top_k=-2 is invalid; allowed: -1 or 0 (off), or an integer >= 1"),
    (dict(top_k=5.0), "top_k=5.0 (float) is invalid; allowed: -1 or 0 (off)"),
    (dict(min_p=-0.1), "min_p=-0.1 is invalid; allowed: 0 <= min_p <= 1"),
    (dict(min_p=2), "min_p=2 is invalid; allowed: 0 <= min_p <= 1"),
    (dict(repetition_penalty=0), "repetition_penalty=0 is invalid; allowed: > 0 (1 means off)"),
    (dict(repetition_penalty=-1.5), "repetition_penalty=-1.5 is invalid; allowed: > 0"),
    (dict(presence_penalty=2.5),
     "presence_penalty=2.5 is invalid; allowed: -2 <= presence_penalty <= 2 (0 means off)"),
    (dict(frequency_penalty=-3),
     "frequency_penalty=-3 is invalid; allowed: -2 <= frequency_penalty <= 2 (0 means off)"),
    (dict(frequency_penalty="1"), "frequency_penalty='1' (str) is invalid"),
    (dict(seed=1.5), "seed=1.5 (float) is invalid; allowed: None or an integer in "
                     "[-2**63, 2**64 - 1]"),
    (dict(seed="42"), "seed='42' (str) is invalid"),
    (dict(seed=2**64), f"seed={2**64} is invalid; allowed: None or an integer in"),
    (dict(stop=""), "stop='' is invalid; allowed: None, a non-empty string or a list of "
                    "non-empty strings"),
    (dict(stop=["ok", ""]), "stop=['ok', ''] is invalid; allowed: None, a non-empty string"),
    (dict(stop=["ok", 3]), "stop=['ok', 3] is invalid"),
    (dict(stop=3), "stop=3 (int) is invalid; allowed: None, a non-empty string"),
    (dict(stop_token_ids=[1, -2]),
     "stop_token_ids=[1, -2] is invalid; allowed: None or a list of integers >= 0"),
    (dict(stop_token_ids=[1, True]), "stop_token_ids=[1, True] is invalid"),
    (dict(stop_token_ids=7), "stop_token_ids=7 (int) is invalid; allowed: None or a list"),
    (dict(ignore_eos=1), "ignore_eos=1 (int) is invalid; allowed: True or False"),
    (dict(include_stop_str_in_output="yes"),
     "include_stop_str_in_output='yes' (str) is invalid; allowed: True or False"),
    (dict(skip_special_tokens=None),
     "skip_special_tokens=None (NoneType) is invalid; allowed: True or False"),
    (dict(detokenize="no"), "detokenize='no' (str) is invalid; allowed: True or False"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens=0 is invalid; allowed: None, -1 (max_model_len) or an "
                                     "integer >= 1"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens=-2 is invalid; allowed: None, -1"),
    (dict(truncate_prompt_tokens=2.5), "truncate_prompt_tokens=2.5 (float) is invalid"),
    (dict(detokenize=False, stop=["\n"]), "stop=['\\n'] is invalid; allowed: None with detokenize=False (stop "
                                          "strings are matched in the decoded text"),
    (dict(logprobs=-1), "logprobs=-1 is invalid; allowed: None or an integer in [0, 20]"),
    (dict(logprobs=21), "logprobs=21 is invalid; allowed: None or an integer in [0, 20]"),
    (dict(logprobs=True), "logprobs=True (bool) is invalid"),
])
def test_invalid_values_are_named(kwargs, message):
    assert error(**kwargs).startswith(message)


def test_error_is_a_value_error():
    with pytest.raises(ValueError, match=re.escape("top_p=0 is invalid")):
        SamplingParams(top_p=0)
