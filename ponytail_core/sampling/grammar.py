"""Grammar-constrained decoding with xgrammar: compile off the engine thread, mask on the device.

Why xgrammar (measured on SmolLM2's 49,152-token vocabulary, benchmarks/probe_grammar_backends.py,
docs/serving.md): filling one row's mask and advancing its matcher takes ~4-10 us against
llguidance's ~40-50 us. That cost is paid by every constrained row at every step, on the engine
thread; compiling (13-40 ms against llguidance's 1-18 ms) is paid once per schema, in a worker
thread, and cached.

- `GrammarCompiler` (one per engine) builds xgrammar's tokenizer info once (~1 s, lazily, in its
  worker) and compiles StructuredOutputsParams there. `submit` returns a Future: equal schemas
  share one compile, and the engine's step thread never waits for one.
- `RequestGrammar` is one request's matcher: `accept` each sampled token, `fill` its mask row.
- `token_bitmask` packs a step's rows into (row indices, [rows, vocab/32] int32 bitmask) for the
  sampler, which applies it on the device (sampling/sampler.py), so constrained and free rows
  share one step.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..errors import ConfigError
from .structured import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
# Compact JSON (", " and ": ", no newlines): a small model sampled at temperature 1 cannot spend its
# tokens on whitespace, and every output is still valid JSON.
_ANY_WHITESPACE = False
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _import_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ConfigError("structured_outputs needs the xgrammar package, which is not installed; "
                          "install it with pip install 'ponytail[structured]'") from None
    return xgrammar


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer in a worker thread, with an LRU cache."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Collection[int]):
        if tokenizer is None:
            raise ConfigError("structured_outputs needs a tokenizer, but this engine has none (tokenizer=None)")
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        # One worker: it alone touches the xgrammar compiler (which spreads a compile over its own threads).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ponytail-grammar")
        self._compiler = None  # xgrammar.GrammarCompiler, built by the first compile (in the pool)
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()  # submit may be called from any thread
        self.num_compiles = 0  # grammars actually compiled (cache misses)

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """A Future of the compiled grammar; it raises ConfigError when the schema cannot compile."""
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def _compile(self, spec: StructuredOutputsParams):
        xgr = _import_xgrammar()
        if self._compiler is None:  # only this pool's thread gets here
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # ours is the cache
        self.num_compiles += 1
        kind = spec.kind
        try:
            if kind == "regex":
                return self._compiler.compile_regex(spec.regex)
            if kind in ("grammar", "choice"):
                return self._compiler.compile_grammar(spec.ebnf())
            schema = '{"type":"object"}' if spec.json is None else spec.json
            return self._compiler.compile_json_schema(schema, any_whitespace=_ANY_WHITESPACE)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses for bad input
            what = {"regex": "a regular expression", "grammar": "an EBNF grammar with a root rule",
                    "choice": "a list of strings"}.get(kind, "a JSON schema")
            raise ConfigError(f"structured_outputs={spec.describe()} cannot be compiled: {_reason(exc)}; "
                              f"allowed: {what} xgrammar supports") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[12:00:00] /project/cpp/file.cc:94: ")."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(exc).splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


class RequestGrammar:
    """One request's matcher: where its output stands in the grammar."""

    def __init__(self, compiled):
        xgr = _import_xgrammar()
        self._matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False when the grammar does not allow it."""
        return self._matcher.accept_token(token)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (host int32, bit t of word t // 32)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: nothing may follow."""
        return self._matcher.is_terminated()


def token_bitmask(grammars: list[RequestGrammar | None], vocab_size: int
                  ) -> tuple[list[int], torch.Tensor] | None:
    """(rows with a grammar, their host bitmask [len(rows), words] int32); None when no row has one."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    bitmask = torch.empty((len(rows), bitmask_words(vocab_size)), dtype=torch.int32)
    for k, i in enumerate(rows):
        grammars[i].fill(bitmask, k)
    return rows, bitmask


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> None:
    """-inf, in place, at every token a constrained row's grammar does not allow (no host sync).

    rows: [c] int64 rows of `logits`; words: [c, ceil(vocab/32)] int32, bit t = token t allowed.
    """
    vocab = logits.shape[1]
    if words.shape[1] * 32 < vocab:
        raise ValueError(f"the grammar bitmask covers {words.shape[1] * 32} tokens; the logits have {vocab}")
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :vocab].bool()
    logits.index_put_((rows,), logits[rows].masked_fill_(~allowed, float("-inf")))
