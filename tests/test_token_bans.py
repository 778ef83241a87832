"""vLLM's allowed_token_ids and bad_words (sampling/bans.py): checked params, the rule that bans a
bad word's last token, the sampler's masks, and the engine running them beside other requests."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ponytail
from ponytail import ConfigError, SamplingParams
from ponytail.sampling.bans import bad_word_endings, tokenize_bad_words
from ponytail.sampling.sampler import SamplingBatch, sample
from test_engine import make_llm, plain_greedy

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(allowed_token_ids=[]), r"allowed_token_ids=\[\] is invalid; allowed: None or a non-empty list of token ids"),
    (dict(allowed_token_ids=[3, -1]), r"allowed_token_ids=\[3, -1\] is invalid"),
    (dict(allowed_token_ids=5), r"allowed_token_ids=5 \(int\) is invalid"),
    (dict(bad_words="Paris"), r"bad_words='Paris' \(str\) is invalid; allowed: None or a list of non-empty strings"),
    (dict(bad_words=["ok", " "]), r"bad_words=\['ok', ' '\] is invalid"),
    (dict(bad_words_token_ids=[[1], []]), r"bad_words_token_ids=\[\[1\], \[\]\] is invalid; allowed: None or a list "
                                          r"of non-empty lists of token ids"),
])
def test_bad_values_are_refused_by_name(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**kwargs)


def test_a_bad_words_last_token_is_banned_only_after_the_rest_of_it():
    words = [[7], [3, 4], [1, 2, 5]]
    assert bad_word_endings(words, []) == [7]
    assert bad_word_endings(words, [9, 3]) == [7, 4]
    assert bad_word_endings(words, [1, 2]) == [7, 5]
    assert bad_word_endings(words, [2, 1]) == [7]


def test_bad_words_are_tokenized_as_written_and_after_a_space(default_model):
    tokenizer = default_model[1]
    bare, spaced = (tokenizer.encode(w, add_special_tokens=False) for w in ("Paris", " Paris"))
    assert tokenize_bad_words(tokenizer, ["Paris"]) == [bare, spaced] and bare != spaced


def _batch(params, outputs=None):
    rows = len(params)
    return SamplingBatch.build(params, outputs or [[] for _ in range(rows)], [[1] for _ in range(rows)],
                               [None] * rows, "cpu")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_sampled_tokens_keep_to_their_allowed_sets(data):
    """Random logits, rows greedy or sampled, some with allowed sets: every row with a set takes a
    token of it, every row without one takes what it would have taken anyway."""
    rows, vocab = data.draw(st.integers(1, 6)), data.draw(st.integers(2, 40))
    logits = torch.tensor(data.draw(st.lists(st.lists(st.floats(-20, 20), min_size=vocab, max_size=vocab),
                                             min_size=rows, max_size=rows)))
    params = []
    for _ in range(rows):
        allowed = data.draw(st.none() | st.lists(st.integers(0, vocab - 1), min_size=1, max_size=vocab))
        params.append(SamplingParams(temperature=data.draw(st.sampled_from([0, 0.7, 1.5])), allowed_token_ids=allowed,
                                     seed=data.draw(st.integers(0, 1000))))
    generators = [torch.Generator().manual_seed(p.seed) for p in params]
    batch = SamplingBatch.build(params, [[] for _ in params], [[1] for _ in params], generators, "cpu")
    out = sample(logits, batch)
    assert not out.bad_rows.any()
    for row, p in enumerate(params):
        token = int(out.token_ids[row])
        if p.allowed_token_ids is not None:
            assert token in p.allowed_token_ids
            if p.greedy:
                assert logits[row, token] == logits[row, p.allowed_token_ids].max()
        elif p.greedy:
            assert logits[row, token] == logits[row].max()


def test_masks_that_leave_no_token_mark_that_row_alone():
    logits = torch.zeros(2, 8)
    stuck = SamplingParams(temperature=0, allowed_token_ids=[3], min_tokens=2, stop_token_ids=[3])
    batch = SamplingBatch.build([stuck, SamplingParams(temperature=0, bad_words_token_ids=[[0], [5, 1]])],
                                [[], [5]], [[1], [1]], [None, None], "cpu")
    out = sample(logits, batch)
    assert out.bad_rows.tolist() == [True, False]
    assert int(out.token_ids[1]) == 2  # 0 and, after 5, 1 are banned: the first of the equal rest
    assert batch.changes_per_step  # the bans follow the output: no reuse of this batch next step


@pytest.mark.network  # the default model
def test_the_engine_bans_a_two_token_word_and_keeps_other_requests_going(small_model):
    model, tokenizer = small_model
    prompt = tokenizer("The capital of France is", add_special_tokens=True)["input_ids"]
    plain = plain_greedy(model, prompt, 12)
    pair = plain[3:5]  # a two-token sequence greedy decoding takes
    llm = make_llm(small_model)
    other = [11, 200, 7, 4000, 12]
    banned, stuck, untouched = llm.generate(
        [prompt, prompt, other],
        [SamplingParams(max_tokens=12, bad_words_token_ids=[pair], **GREEDY),
         SamplingParams(max_tokens=4, allowed_token_ids=[7], min_tokens=2, stop_token_ids=[7], temperature=0),
         SamplingParams(max_tokens=12, **GREEDY)])
    tokens = banned.token_ids
    assert tokens[:3] == plain[:3] and tokens[3] == pair[0] and tokens[4] != pair[1]
    assert all(tokens[i:i + 2] != pair for i in range(len(tokens) - 1))
    assert stuck.error is not None and "left no token to take" in stuck.error
    assert untouched.token_ids == plain_greedy(model, other, 12)
    assert llm.stats().used_blocks == 0 and llm.engine.cache.invariants() == []


def test_token_ids_outside_the_vocabulary_are_refused_before_any_step(small_model):
    llm = make_llm(small_model)
    for field, value in (("logit_bias", {10**6: 1.0}), ("allowed_token_ids", [5, 10**6]),
                         ("bad_words_token_ids", [[10**6]])):
        with pytest.raises(ConfigError, match=rf"{field}=\[1000000\] are outside the vocabulary: allowed: token "
                                              r"ids in \[0, 49152\)"):
            llm.generate("Hello", SamplingParams(**{field: value}))
    assert llm.stats().num_waiting == 0 and llm.engine.requests == {}
    no_tokenizer = ponytail.LLM(small_model[0], kv_cache_memory="4MiB", max_num_seqs=2, max_model_len=64)
    with pytest.raises(ConfigError, match=r"bad_words=\['x'\] needs a tokenizer, but this engine has none; use "
                                          r"bad_words_token_ids"):
        no_tokenizer.generate([[1, 2, 3]], SamplingParams(bad_words=["x"]))
