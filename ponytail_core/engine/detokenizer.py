"""IncrementalDetokenizer: one request's generated tokens -> text deltas, cut at stop strings.

Two things can make the text of the tokens so far unfit to hand out yet:
- a character split over several tokens (byte-level BPE, byte fallback) decodes to U+FFFD until
  its last byte arrives. The prefix/read-offset technique of vLLM and HF's TextStreamer decodes
  a short window of tokens twice per step, with and without the new ones, and hands out the
  difference only when it does not end in U+FFFD. The few tokens of context before the new ones
  let the tokenizer place spaces as it would in the middle of the text.
- a stop string may be arriving a piece at a time. The last (longest stop string - 1) characters
  are held back until the next step shows they do not start one.
"""

from __future__ import annotations

from ..sampling.params import SamplingParams

try:
    from tokenizers.decoders import DecodeStream  # tokenizers >= 0.21
except ImportError:  # an older tokenizers: every request takes the window technique
    DecodeStream = None

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first generated one (vLLM's initial offset).
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text deltas for one request, from a transformers tokenizer.

    Call step() with each step's new tokens and send what it returns; call flush() once at the
    end. When EOS or a stop_token_ids token ends the request, leave that token out of step() if
    its text should not appear (vLLM omits it unless include_stop_str_in_output).

    Stop strings follow vLLM except that when several match, the one completed first (as if the
    text arrived one character at a time) wins. They are looked for only once more than
    min_tokens tokens exist, as in vLLM; a stop string completed earlier is not looked for again.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids = list(prompt_token_ids)  # prompt, then every generated token
        self._num_prompt = len(self._ids)
        self._prefix_offset = max(len(self._ids) - CONTEXT_TOKENS, 0)  # window start (context)
        self._read_offset = len(self._ids)  # first token whose text is not yet decoded
        self._prefix_text: str | None = None  # decode of the context, cached while it stands
        self._decoded = ""  # complete characters decoded so far (cut at a stop string)
        self._emitted = 0  # characters of _decoded handed out
        self.finished_by_stop: str | None = None  # the stop string that ended the text

    @property
    def text(self) -> str:
        """Everything handed out so far."""
        return self._decoded[: self._emitted]

    @property
    def num_output_tokens(self) -> int:
        return len(self._ids) - self._num_prompt

    def step(self, new_token_ids: list[int]) -> str:
        """Add generated tokens; return the text now final (possibly ""). "" once stopped."""
        if self.finished_by_stop is not None:
            return ""
        self._ids.extend(new_token_ids)
        return self._emit(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """Return the text still held back, up to a stop string; call once, at the end."""
        delta = self._decode_new(final=True) if self.finished_by_stop is None else ""
        return self._emit(delta, final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens past the read offset, or "" while it ends mid-character."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        if len(text) <= len(self._prefix_text):
            return ""
        if text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        delta = text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        return delta

    def _emit(self, delta: str, final: bool) -> str:
        """Append delta, cut at a stop string, and hand out all but the held-back tail."""
        start = len(self._decoded)
        self._decoded += delta
        if delta and self._stop and self.num_output_tokens > self._min_tokens:
            self._cut_at_stop(start)
        if self.finished_by_stop is not None:
            final = True
        end = len(self._decoded) if final else max(self._emitted, len(self._decoded) - self._hold)
        out = self._decoded[self._emitted:end]
        self._emitted = end
        return out

    def _cut_at_stop(self, start: int) -> None:
        """Look for stop strings ending past start; truncate at the first one completed."""
        best: tuple[int, int, str] | None = None  # (end, begin, stop string); ties: longest
        for stop in self._stop:
            begin = self._decoded.find(stop, max(start - len(stop) + 1, 0))
            if begin >= 0:
                found = (begin + len(stop), begin, stop)
                best = found if best is None else min(best, found)
        if best is None:
            return
        end, begin, stop = best
        self._decoded = self._decoded[: end if self._include_stop else begin]
        self.finished_by_stop = stop


class StreamDetokenizer(IncrementalDetokenizer):
    """IncrementalDetokenizer's stop strings and hold-back, with the decoding done by the tokenizers
    library's DecodeStream (one Rust call per token, as vLLM's fast detokenizer): the window
    technique above costs two `tokenizer.decode` calls per request per step, a quarter of the host
    time of a 256-sequence step on a small model (docs/benchmarks.md). For fast tokenizers only
    (`make_detokenizer` picks)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams, backend) -> None:
        super().__init__(tokenizer, prompt_token_ids, params)
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._unread: list[int] = []  # stepped ids whose text is not out yet (a character still split)
        for token in prompt_token_ids[-CONTEXT_TOKENS:]:  # context: spaces placed as mid-text
            self._stream.step(backend, token)

    def _decode_new(self, final: bool) -> str:
        pieces = []
        for token in self._ids[self._read_offset:]:
            piece = self._stream.step(self._backend, token)
            if piece is None:
                self._unread.append(token)
            else:
                pieces.append(piece)
                self._unread.clear()
        self._read_offset = len(self._ids)
        if final and self._unread:  # bytes of a character that never completed: U+FFFD, as decode gives
            pieces.append(self._decode(self._unread))
            self._unread.clear()
        return "".join(pieces)


def make_detokenizer(tokenizer, prompt_token_ids: list[int], params: SamplingParams):
    """The detokenizer for a request: none without a tokenizer or with detokenize=False, DecodeStream's
    for a fast one."""
    if tokenizer is None or not params.detokenize:
        return NoTextDetokenizer()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and DecodeStream is not None:
        return StreamDetokenizer(tokenizer, prompt_token_ids, params, backend)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params)


class NoTextDetokenizer:
    """For engines run without a tokenizer, and requests with detokenize=False (token ids in, token
    ids out): no text is produced."""

    finished_by_stop = None
    text = ""

    def step(self, new_token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""
