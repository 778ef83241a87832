"""SegmentCache: a chat's token ids from cached pieces equal the chat template's own tokenizing,
whatever the messages hold (special-token text, whitespace, unicode); earlier turns are taken from
the cache; tokenizers where pieces would not tokenize alike are refused."""

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from deployments.api.prompts import chat_token_ids
from deployments.api.segment_tokens import SegmentCache

pytestmark = pytest.mark.network  # the default model's tokenizer

PIECES = list("ab cd\n\t é中🙂.,'") + ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "  ", "user", "<|im", "|>"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)  # special-token text inside messages too
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT})


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model[1]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversation=st.lists(MESSAGE, min_size=1, max_size=6))
def test_cached_pieces_give_the_templates_ids(tokenizer, conversation):
    segments = SegmentCache(tokenizer)
    assert segments.usable
    want = chat_token_ids(tokenizer, conversation)
    assert chat_token_ids(tokenizer, conversation, segments=segments) == want
    assert chat_token_ids(tokenizer, conversation, segments=segments) == want  # now from the cache


def test_a_next_turn_tokenizes_only_its_new_messages(tokenizer):
    segments = SegmentCache(tokenizer)
    system = {"role": "system", "content": "A shared document. " * 600}
    turn = [system, {"role": "user", "content": "first question"}]
    chat_token_ids(tokenizer, turn, segments=segments)
    misses = segments.misses
    turn += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "second question"}]
    ids = chat_token_ids(tokenizer, turn, segments=segments)
    assert ids == chat_token_ids(tokenizer, turn)
    # New: the answer and the second question, plus the short pieces around them ("assistant\n" ...).
    assert segments.misses - misses <= 4 and segments.hits >= 2


def test_the_cache_keeps_at_most_max_tokens(tokenizer):
    segments = SegmentCache(tokenizer, max_tokens=400)
    for i in range(20):
        chat_token_ids(tokenizer, [{"role": "user", "content": f"message {i} " + "word " * 30}], segments=segments)
    assert 0 < segments._size <= 400


def test_tokenizers_whose_pieces_would_not_tokenize_alike_are_refused(tokenizer):
    stripping = copy.deepcopy(tokenizer)
    stripping.add_special_tokens({"additional_special_tokens": [AddedToken("<sep>", lstrip=True, special=True)]})
    assert not SegmentCache(stripping).usable
    splitting = copy.deepcopy(tokenizer)
    splitting.split_special_tokens = True
    assert not SegmentCache(splitting).usable
    assert not SegmentCache(object()).usable  # no fast tokenizer
    conversation = [{"role": "user", "content": "hello <sep> there"}]
    assert chat_token_ids(stripping, conversation, segments=SegmentCache(stripping)) == chat_token_ids(
        stripping, conversation)  # refused: the template tokenizes it whole
