"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names, defaults).

A user who knows `vllm.SamplingParams` can pass the same keyword arguments here. Every value is
checked in __post_init__; a bad one raises `ponytail.ConfigError` naming the parameter, the value
given and what is allowed. With n > 1 (or best_of) the engine prefills the prompt once and forks
it into that many sequences (`member`'s params each), which share the prompt's KV blocks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from numbers import Integral, Real

from ..errors import ConfigError
from .structured import StructuredOutputsParams

# Below this a temperature counts as greedy, as in vLLM (_SAMPLING_EPS): dividing logits by a
# tinier number only risks overflow, and the softmax is one-hot anyway.
GREEDY_TEMPERATURE = 1e-5
# The most top logprobs a request may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# The most token ids one request may track with logprob_token_ids (vLLM's MAX_LOGPROB_TOKEN_IDS).
MAX_LOGPROB_TOKEN_IDS = 128
# The most sequences one request may sample (n, best_of): each takes a running slot.
MAX_SAMPLES = 128
# The seeds torch.Generator.manual_seed accepts.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _invalid(name: str, value: object, allowed: str) -> ConfigError:
    return ConfigError(f"{name}={value!r} is invalid; allowed: {allowed}")


def _wrong_type(name: str, value: object, allowed: str) -> ConfigError:
    return ConfigError(
        f"{name}={value!r} ({type(value).__name__}) is invalid; allowed: {allowed}"
    )


def _int(name: str, value: object, allowed: str, low: int, high: int | None = None) -> int:
    """value as an int in [low, high]; bool is not an int."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise _wrong_type(name, value, allowed)
    if value < low or (high is not None and value > high):
        raise _invalid(name, value, allowed)
    return int(value)


def _float(name: str, value: object, allowed: str, ok) -> float:
    """value as a finite float for which ok(value) holds; bool and strings are not numbers."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise _wrong_type(name, value, allowed)
    value = float(value)
    if not math.isfinite(value):
        raise _invalid(name, value, f"{allowed}, finite")
    if not ok(value):
        raise _invalid(name, _plain(value), allowed)
    return value


def _plain(value: float) -> float | int:
    """0.0 -> 0 so messages read `top_p=0`, as the user most likely typed it."""
    return int(value) if value.is_integer() else value


def _token_id(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, Integral) and value >= 0


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _wrong_type(name, value, "True or False")
    return value


@dataclass(slots=True)
class SamplingParams:
    """Sampling and stopping rules for one request; the fields, defaults and meanings are vLLM's.

    Processing order in the sampler (vLLM v1): allowed_token_ids, bad_words and min_tokens masks,
    structured outputs, logit_bias, penalties, then greedy argmax, or temperature, min_p, top_k,
    top_p and a random draw.
    """

    n: int = 1  # sequences returned per request
    best_of: int | None = None  # sequences sampled; the n of highest cumulative logprob are returned (None: n)
    max_tokens: int = 16  # the most tokens to generate
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    temperature: float = 1.0  # logits are divided by it; 0 (anything < 1e-5) means greedy
    top_p: float = 1.0  # keep the smallest set of top tokens whose probability sum >= top_p
    top_k: int = 0  # keep the top_k most likely tokens; 0 or -1 means off (-1 becomes 0)
    min_p: float = 0.0  # drop tokens less likely than min_p x the top token's probability
    repetition_penalty: float = 1.0  # HF/vLLM: > 1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0  # OpenAI: subtracted once from tokens already in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    seed: int | None = None  # the request samples from its own generator seeded with this
    stop: str | list[str] | None = None  # strings that end the text; normalized to a list
    stop_token_ids: list[int] | None = None  # tokens that end generation; normalized to a list
    ignore_eos: bool = False  # keep generating past EOS
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    logprobs: int | None = None  # top logprobs to return besides the sampled token's; None: none
    prompt_logprobs: int | None = None  # per prompt token: its logprob and this many top ones; None: none
    # Tokens whose logprobs each step returns besides the sampled one's, instead of the top ones
    # (label scoring: "yes"/"no"). logprobs becomes their count (vLLM: it may only equal it).
    logprob_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100..100, OpenAI's)
    skip_special_tokens: bool = True  # leave special tokens out of the detokenized text
    detokenize: bool = True  # vLLM's: False returns token ids only (text ""), the host decodes nothing
    truncate_prompt_tokens: int | None = None  # vLLM's: run only the prompt's last this many tokens (-1: max_model_len)
    structured_outputs: StructuredOutputsParams | None = None  # JSON the output must match (or a dict)
    allowed_token_ids: list[int] | None = None  # the only tokens the output may take; None: any
    bad_words: list[str] | None = None  # words the output may not contain (the engine tokenizes them)
    # A reasoning model thinks at most this many tokens, then the engine closes its thought (vLLM's;
    # -1 is None: no limit). Needs a tokenizer with <think> and </think> tokens (sampling.thinking).
    thinking_token_budget: int | None = None
    # bad_words as token sequences, which the engine fills from bad_words with its tokenizer; may be
    # given directly (an engine without a tokenizer). A sequence's last token is banned after the rest.
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, f"an integer in [1, {MAX_SAMPLES}]", 1, MAX_SAMPLES)
        if self.best_of is not None:
            self.best_of = _int("best_of", self.best_of, f"None or an integer in [n={self.n}, {MAX_SAMPLES}]",
                                self.n, MAX_SAMPLES)
        self.max_tokens = _int("max_tokens", self.max_tokens, "an integer >= 1", 1)
        self.min_tokens = _int("min_tokens", self.min_tokens, "an integer >= 0", 0)
        if self.min_tokens > self.max_tokens:
            raise _invalid("min_tokens", self.min_tokens,
                           f"an integer <= max_tokens={self.max_tokens}")
        self.temperature = _float("temperature", self.temperature, ">= 0 (0 means greedy)",
                                  lambda v: v >= 0)
        self.top_p = _float("top_p", self.top_p, "0 < top_p <= 1", lambda v: 0 < v <= 1)
        self.top_k = _int("top_k", self.top_k, "-1 or 0 (off), or an integer >= 1", -1)
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _float("min_p", self.min_p, "0 <= min_p <= 1", lambda v: 0 <= v <= 1)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty,
                                         "> 0 (1 means off)", lambda v: v > 0)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name), f"-2 <= {name} <= 2 (0 means off)",
                           lambda v: -2 <= v <= 2)
            setattr(self, name, value)
        if self.seed is not None:
            # Sample i of the request is seeded with seed + i: distinct, and reproducible.
            k = self.num_samples
            allowed = ("None or an integer in [-2**63, 2**64 - 1]" if k == 1 else
                       f"None or an integer in [-2**63, 2**64 - {k}] (sample i is seeded with seed + i)")
            self.seed = _int("seed", self.seed, allowed, _SEED_MIN, _SEED_MAX - (k - 1))
        if self.truncate_prompt_tokens is not None:
            allowed = "None, -1 (max_model_len) or an integer >= 1"
            self.truncate_prompt_tokens = _int("truncate_prompt_tokens", self.truncate_prompt_tokens, allowed, -1)
            if self.truncate_prompt_tokens == 0:
                raise _invalid("truncate_prompt_tokens", 0, allowed)
        self.stop = self._check_stop(self.stop)
        self.stop_token_ids = self._check_stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            _bool(name, getattr(self, name))
        if self.stop and not self.detokenize:  # vLLM refuses it too: stop strings are found in the text
            raise _invalid("stop", self.stop, "None with detokenize=False (stop strings are matched in the "
                           "decoded text; stop_token_ids end generation without it)")
        tracked = isinstance(self.logprob_token_ids, (list, tuple)) and self.logprobs == len(self.logprob_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not (name == "logprobs" and tracked):  # checked below
                setattr(self, name, _int(name, getattr(self, name),
                                         f"None or an integer in [0, {MAX_LOGPROBS}]", 0, MAX_LOGPROBS))

        self._check_logprob_token_ids()
        if self.thinking_token_budget is not None:
            self.thinking_token_budget = _int("thinking_token_budget", self.thinking_token_budget,
                                              "None, -1 (no limit) or an integer >= 0", -1)
            self.thinking_token_budget = None if self.thinking_token_budget == -1 else self.thinking_token_budget
        self.logit_bias = self._check_logit_bias(self.logit_bias)
        self._check_bans()
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
            # The grammar allows only EOS once the JSON is complete: masking EOS (min_tokens) or
            # ignoring it would leave a row with no token to take.
            for name, off in (("min_tokens", 0), ("ignore_eos", False)):
                if getattr(self, name) != off:
                    raise _invalid(name, getattr(self, name),
                                   f"{off} with structured_outputs (the output ends where the constraint does)")
            if self.thinking_token_budget is not None:  # the grammar binds every output token, a thought's too
                raise _invalid("thinking_token_budget", self.thinking_token_budget,
                               "None with structured_outputs (the constraint binds the whole output, thought included)")

    def _check_logprob_token_ids(self) -> None:
        ids = self.logprob_token_ids
        if ids is None:
            return
        allowed = f"None or a list of 1 to {MAX_LOGPROB_TOKEN_IDS} token ids (integers >= 0)"
        if not isinstance(ids, (list, tuple)):
            raise _wrong_type("logprob_token_ids", ids, allowed)
        if not 1 <= len(ids) <= MAX_LOGPROB_TOKEN_IDS or not all(_token_id(t) for t in ids):
            shown = repr(ids) if len(ids) <= 8 else f"[...] ({len(ids)} ids)"
            raise ConfigError(f"logprob_token_ids={shown:.80} is invalid; allowed: {allowed}")
        self.logprob_token_ids = [int(t) for t in ids]
        if self.logprobs is None:
            self.logprobs = len(ids)
        elif self.logprobs != len(ids):
            raise _invalid("logprobs", self.logprobs, f"None or len(logprob_token_ids)={len(ids)} "
                           "(the tracked tokens replace the top ones)")

    @staticmethod
    def _check_logit_bias(bias: object) -> dict[int, float] | None:
        allowed = "None or a dict of token ids (integers >= 0) to biases in [-100, 100]"
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise _wrong_type("logit_bias", bias, allowed)
        out = {}
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, Integral) or token < 0:
                raise _invalid("logit_bias", bias, allowed)
            if isinstance(value, bool) or not isinstance(value, Real) or not -100 <= value <= 100:
                raise _invalid("logit_bias", bias, allowed)
            out[int(token)] = float(value)
        return out or None

    def _check_bans(self) -> None:
        if self.allowed_token_ids is not None:
            allowed = "None or a non-empty list of token ids (integers >= 0)"
            if not isinstance(self.allowed_token_ids, (list, tuple)):
                raise _wrong_type("allowed_token_ids", self.allowed_token_ids, allowed)
            if not self.allowed_token_ids or not all(_token_id(t) for t in self.allowed_token_ids):
                raise _invalid("allowed_token_ids", self.allowed_token_ids, allowed)
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.bad_words is not None:
            allowed = "None or a list of non-empty strings"
            if not isinstance(self.bad_words, (list, tuple)):
                raise _wrong_type("bad_words", self.bad_words, allowed)
            if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise _invalid("bad_words", self.bad_words, allowed)
            self.bad_words = list(self.bad_words) or None
        if self.bad_words_token_ids is not None:
            allowed = "None or a list of non-empty lists of token ids (integers >= 0)"
            sequences = self.bad_words_token_ids
            if not isinstance(sequences, (list, tuple)) or not all(
                    isinstance(q, (list, tuple)) and q and all(_token_id(t) for t in q) for q in sequences):
                raise _invalid("bad_words_token_ids", sequences, allowed)
            self.bad_words_token_ids = [[int(t) for t in q] for q in sequences] or None

    @property
    def named_token_ids(self) -> dict[str, list[int]]:
        """The token ids these params name, by parameter: an engine checks them against its
        vocabulary before the request runs."""
        return {"logit_bias": list(self.logit_bias or ()), "stop_token_ids": self.stop_token_ids,
                "allowed_token_ids": self.allowed_token_ids or [], "logprob_token_ids": self.logprob_token_ids or [],
                "bad_words_token_ids": [t for q in self.bad_words_token_ids or () for t in q]}

    @staticmethod
    def _check_stop(stop: object) -> list[str]:
        allowed = "None, a non-empty string or a list of non-empty strings"
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            raise _wrong_type("stop", stop, allowed)
        for item in items:
            if not isinstance(item, str) or not item:
                raise _invalid("stop", stop, allowed)
        return list(items)

    @staticmethod
    def _check_stop_token_ids(ids: object) -> list[int]:
        allowed = "None or a list of integers >= 0"
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise _wrong_type("stop_token_ids", ids, allowed)
        for item in ids:
            if isinstance(item, bool) or not isinstance(item, Integral) or item < 0:
                raise _invalid("stop_token_ids", ids, allowed)
        return [int(item) for item in ids]

    @property
    def num_samples(self) -> int:
        """Sequences the engine samples for the request: best_of, else n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def ranks_samples(self) -> bool:
        """More sequences are sampled than returned: the n of highest cumulative logprob are kept."""
        return self.num_samples > self.n

    def member(self, index: int) -> SamplingParams:
        """The params of sample `index` of a request with several: one sequence, seeded seed + index.
        Only sample 0 keeps prompt_logprobs (the prompt is scored once); when samples are ranked,
        every one records its tokens' logprobs (logprobs=0 at least), which the ranking sums."""
        logprobs = self.logprobs
        if self.ranks_samples and logprobs is None:
            logprobs = 0
        return dataclasses.replace(self, n=1, best_of=None, logprobs=logprobs,
                                   seed=None if self.seed is None else self.seed + index,
                                   prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax: temperature 0 (below 1e-5, as vLLM) or top_k == 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
