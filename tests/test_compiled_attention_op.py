"""ponytail::attention, the custom op compiled layers call (attention/compiled_op.py), without a model:
a stand-in cache records what the op hands it. The compiled engine itself: tests/test_engine.py
(test_compiled_decoder_layers_keep_greedy_output) and, on CUDA, tests/test_gpu_engine.py."""

from __future__ import annotations

import pytest
import torch

import ponytail  # noqa: F401  (registers the op)
from ponytail.attention import compiled_op
from ponytail.attention.hf_cache_base import PagedCacheBase


class RecordingCache:
    """attend() as the step caches answer it ([B, T, Hq, D]), from plain SDPA; records its calls."""

    def __init__(self, fail: bool = False):
        self.calls: list[tuple] = []
        self.abandoned = 0
        self.fail = fail

    def attend(self, layer_idx, module, query, key, value, mask, scale, sliding_window):
        self.calls.append((layer_idx, module, mask, scale, sliding_window))
        if self.fail:
            raise ValueError("kernel refused the step")
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)
        return out.transpose(1, 2)  # [B, T, Hq, D], not contiguous: the op hands back contiguous

    def abandon_step(self):
        self.abandoned += 1

    attend_or_abandon = PagedCacheBase.attend_or_abandon  # the step caches' own wrapper around attend()


def qkv(tokens: int = 5, heads: int = 4, head_dim: int = 8):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, tokens, head_dim, generator=gen) for _ in range(3)]


def test_the_op_runs_the_named_layer_of_the_named_cache():
    cache, module = RecordingCache(), torch.nn.Identity()
    q, k, v = qkv()
    with compiled_op.calling(cache, module, 7):
        out = torch.ops.ponytail.attention(q, k, v, None, 0.25, 4096)
    assert cache.calls == [(7, module, None, 0.25, 4096)]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    assert out.is_contiguous() and out.shape == (1, 5, 4, 8)
    assert compiled_op._current is None  # the call is over


def test_the_op_matches_its_fake_for_compiled_graphs():
    """torch.library.opcheck: schema, fake (meta) shapes and strides against the real call."""
    q, k, v = qkv()
    with compiled_op.calling(RecordingCache(), torch.nn.Identity(), 0):
        torch.library.opcheck(torch.ops.ponytail.attention.default, (q, k, v, None, 0.35, None),
                              test_utils=("test_schema", "test_faketensor"))


def test_the_op_outside_a_compiled_layers_call_says_so():
    with pytest.raises(RuntimeError, match=r"ponytail::attention runs inside a compiled layer's call "
                                           r"\(runner/compile.py\), which names the cache and the layer; none is active"):
        torch.ops.ponytail.attention(*qkv(), None, 0.25, None)


def test_a_failed_attend_abandons_the_step_and_raises_its_error():
    cache = RecordingCache(fail=True)
    with compiled_op.calling(cache, torch.nn.Identity(), 0), pytest.raises(ValueError, match="kernel refused"):
        torch.ops.ponytail.attention(*qkv(), None, 0.25, None)
    assert cache.abandoned == 1
    assert compiled_op._current is None


def test_a_compiled_layer_hands_its_cache_and_index_to_the_op_and_refuses_grad_mode():
    """runner/compile.py's wrapper: the Ponytail cache stays out of the traced call (no update(),
    so no graph break), the op is told the cache and the layer's real index, and a call that would
    want a backward is refused with what to do."""
    from ponytail.attention.hf_cache_base import LAYER_INDEX_ATTR
    from ponytail.errors import ConfigError
    from ponytail.runner.compile import _compiled_for_ponytail_caches
    from ponytail.runner.step_cache import PackedStepCache

    layer, attention = torch.nn.Module(), torch.nn.Module()
    setattr(attention, LAYER_INDEX_ATTR, 3)
    seen = []

    def compiled(*args, **kwargs):
        seen.append((args, kwargs, compiled_op._current))
        return "hidden states"

    forward = _compiled_for_ponytail_caches(layer, attention, compiled)
    cache = object.__new__(PackedStepCache)  # only its type is read here
    with pytest.raises(ConfigError, match=r"a compiled layer with a Ponytail cache runs inference only: call the "
                                          r"model under torch.inference_mode\(\) or torch.no_grad\(\)"):
        forward("h", cache=cache)
    assert not seen
    with torch.inference_mode():
        assert forward("h", cache=cache, position_ids=1) == "hidden states"
    [(args, kwargs, call)] = seen
    assert args == ("h",) and kwargs == {"position_ids": 1, compiled_op.COMPILED_CALL: True}
    assert (call.cache, call.module, call.layer_idx) == (cache, attention, 3)
    assert compiled_op._current is None
    # Without a cache the compiled forward runs as it is, told nothing.
    assert forward("h", cache=None) == "hidden states"
    assert seen[-1] == (("h",), {"cache": None}, None)
