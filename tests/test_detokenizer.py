"""IncrementalDetokenizer with real byte-level BPE tokenizers built offline.

The tokenizer is trained here on ASCII text only, so é, 中 and emoji stay split into byte tokens
that decode to U+FFFD on their own: the case the prefix/read-offset technique exists for.
"""

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ponytail.engine.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer, StreamDetokenizer, make_detokenizer
from ponytail.sampling.params import SamplingParams

SMOLLM2 = Path("/root/.cache/ponytail/models/smollm2-135m-instruct")
TEXT = "Héllo wörld, 中文 text 🙂👍🏽 and café. The end is near; STOP here or not."
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, the end is near",
          "text and more text; stop here or not.", "The End Is Near. STOP!"] * 20


@pytest.fixture(scope="module")
def tok():
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>", "<sep>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>",
                                   additional_special_tokens=["<sep>"])


def window(tok, prompt, params):
    return IncrementalDetokenizer(tok, prompt, params)


def decode_stream(tok, prompt, params):
    return StreamDetokenizer(tok, prompt, params, tok.backend_tokenizer)


@pytest.fixture(params=[window, decode_stream], ids=["window", "decode_stream"])
def make(request):
    """Both detokenizers pass every test that takes this fixture: same text, same stop rules."""
    return request.param


def stream(tok, ids, prompt=(), chunk=1, make=window, **params):
    """Feed ids `chunk` at a time; return (deltas including the flush, detokenizer)."""
    detok = make(tok, list(prompt), SamplingParams(**params))
    deltas = [detok.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas, detok


def test_the_tokenizer_splits_characters(tok):
    ids = tok.encode("中🙂")
    assert len(ids) == 7 and all("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
@pytest.mark.parametrize("prompt", ["", "Prompt: café 中"])
def test_deltas_add_up_to_the_decode_and_never_split_a_character(tok, chunk, prompt, make):
    ids = tok.encode(TEXT)
    deltas, detok = stream(tok, ids, tok.encode(prompt), chunk, make)
    assert "".join(deltas) == tok.decode(ids) == TEXT == detok.text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.finished_by_stop is None and detok.num_output_tokens == len(ids)
    if chunk == 1:
        assert deltas.count("") >= 10  # held while characters were incomplete


def test_decodes_a_small_window_not_the_whole_sequence(tok):
    sizes = []
    decode = tok.decode

    class Spy:
        def decode(self, ids, **kwargs):
            sizes.append(len(ids))
            return decode(ids, **kwargs)

    ids = tok.encode(TEXT * 4)
    deltas, _ = stream(Spy(), ids, tok.encode("a long prompt " * 20))
    assert "".join(deltas) == TEXT * 4
    assert max(sizes) <= CONTEXT_TOKENS + 4  # context + the 4 bytes of the longest character


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip, make):
    ids = tok.encode("one<sep>two 中<eos>")
    deltas, _ = stream(tok, ids, make=make, skip_special_tokens=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == ("onetwo 中" if skip else "one<sep>two 中<eos>")


def test_invalid_bytes_at_the_end_come_out_at_flush(tok, make):
    ids = tok.encode("ab 中")[:-1]  # the last byte of 中 never arrives
    deltas, _ = stream(tok, ids, make=make)
    assert deltas[-1].endswith("\ufffd") and "".join(deltas) == tok.decode(ids)


@pytest.mark.parametrize("stop, include, expected", [
    ("near; STOP", False, "Héllo wörld, 中文 text 🙂👍🏽 and café. The end is "),
    ("near; STOP", True, "Héllo wörld, 中文 text 🙂👍🏽 and café. The end is near; STOP"),
    ("文 t", False, "Héllo wörld, 中"),  # the stop string starts inside a split character
    ("🙂👍", True, "Héllo wörld, 中文 text 🙂👍"),  # ends before the skin-tone modifier
    ("o", False, "Héll"),  # inside a token
])
def test_stop_strings_across_tokens(tok, stop, include, expected, make):
    ids = tok.encode(TEXT)
    if len(stop) > 1:  # no single token holds the stop string
        assert all(stop not in tok.decode([i]) for i in ids)
    for chunk in (1, 4):
        deltas, detok = stream(tok, ids, chunk=chunk, make=make, stop=[stop, "never"],
                               include_stop_str_in_output=include)
        # Deltas only ever append, so a partly emitted stop string would show up here.
        assert "".join(deltas) == detok.text == expected
        assert detok.finished_by_stop == stop
        assert deltas[-1] == "" and detok.step(ids[:3]) == "" and detok.flush() == ""


def test_held_back_text_is_at_most_the_longest_stop_minus_one(tok, make):
    ids = tok.encode("hello world, the end")
    detok = make(tok, [], SamplingParams(stop=["xyz", "never!"]))
    for i in ids:
        detok.step([i])
    full = tok.decode(ids)
    assert detok.text == full[:-5]
    assert detok.flush() == full[-5:]


def test_the_stop_string_completed_first_wins(tok, make):
    ids = tok.encode("abcdef")
    deltas, detok = stream(tok, ids, make=make, stop=["bcdef", "cd", "bcd"])
    assert "".join(deltas) == "a" and detok.finished_by_stop == "bcd"  # ties: the longer


def test_stop_strings_wait_for_min_tokens(tok, make):
    ids = tok.encode("x. y. z.")
    deltas, detok = stream(tok, ids, make=make, stop=["."], min_tokens=3, max_tokens=16)
    assert tok.decode(ids[:3]) == "x. "  # the first "." completes before min_tokens
    assert "".join(deltas) == "x. y" and detok.finished_by_stop == "."


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(),
                    reason=f"no converted SmolLM2 checkpoint at {SMOLLM2}")
def test_smollm2_tokenizer(make):
    smol = AutoTokenizer.from_pretrained(SMOLLM2, local_files_only=True)
    text = " Ünïcode 𝔘𝔫𝔦 龘龘 🦜🏳️‍🌈 done"
    ids = smol.encode(text)
    assert any("\ufffd" in smol.decode([i]) for i in ids)
    prompt = smol.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    for chunk in (1, 3):
        deltas, _ = stream(smol, ids + [smol.eos_token_id], prompt, chunk, make)
        assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    deltas, detok = stream(smol, ids, prompt, make=make, stop=["龘 🦜"])
    assert "".join(deltas) == " Ünïcode 𝔘𝔫𝔦 龘" and detok.finished_by_stop == "龘 🦜"


def test_make_detokenizer_takes_decode_stream_for_fast_tokenizers_only(tok):
    params = SamplingParams()
    assert type(make_detokenizer(tok, [1, 2], params)) is StreamDetokenizer

    class Slow:  # no backend_tokenizer: a slow (Python) tokenizer
        decode = tok.decode

    assert type(make_detokenizer(Slow(), [1, 2], params)) is IncrementalDetokenizer
    assert make_detokenizer(None, [1, 2], params).step([5]) == ""
