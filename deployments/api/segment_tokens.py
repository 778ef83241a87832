"""Token ids of chat-template text, tokenized once per piece between special tokens.

A conversation's next turn sends the whole conversation again: a 2,400-token system prompt and
every earlier turn, retokenized on every request (4.7 ms for a documents-chat prompt on this
repository's CPU machine), in the prefix router and again in a replica under the other routers.
A fast tokenizer cuts its input at its added tokens (`<|im_start|>` ...) before anything else and
tokenizes each piece between them on its own, so a piece's ids do not depend on its neighbours:
the ids of a rendered chat are the ids of its pieces, joined. This cache keeps the ids of recent
pieces (the shared system prompts, earlier turns), so a turn tokenizes only its new messages.

It takes only tokenizers where that cutting is exact: a fast tokenizer whose added tokens match
verbatim (no lstrip / rstrip / single_word, and none matched after a normaliser). Anything else,
and any error, goes back to the tokenizer itself.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

DEFAULT_MAX_TOKENS = 1 << 20  # ids kept in all, 4 bytes each: 4 MiB


class SegmentCache:
    def __init__(self, tokenizer: Any, max_tokens: int = DEFAULT_MAX_TOKENS):
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.max_tokens = max_tokens
        self._ids: dict[str, int] = {}
        self._split: re.Pattern | None = None
        self._pieces: OrderedDict[str, array] = OrderedDict()  # least recently used first
        self._size = 0
        self._lock = threading.Lock()  # the router tokenizes long prompts in worker threads
        self.hits = self.misses = 0
        if self.backend is None:
            return
        if getattr(tokenizer, "split_special_tokens", False):  # special tokens in text tokenized as text
            return
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        normalizer = self.backend.normalizer is not None
        if any(t.lstrip or t.rstrip or t.single_word or (t.normalized and normalizer) for t in added.values()):
            return
        self._ids = {t.content: i for i, t in added.items()}
        if self._ids:  # longest first: a token that starts another never cuts it short
            words = sorted(self._ids, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(re.escape(w) for w in words) + ")")

    @property
    def usable(self) -> bool:
        return self._split is not None

    def encode(self, text: str) -> list[int]:
        """The ids `tokenizer(text, add_special_tokens=False)` gives (usable tokenizers only)."""
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # an added token: re.split puts the separators at odd places
                ids.append(self._ids[piece])
            elif piece:
                ids.extend(self._piece(piece))
        return ids

    def _piece(self, piece: str) -> array:
        with self._lock:
            cached = self._pieces.get(piece)
            if cached is not None:
                self._pieces.move_to_end(piece)
                self.hits += 1
                return cached
        ids = array("I", self.backend.encode(piece, add_special_tokens=False).ids)  # releases the GIL
        with self._lock:
            self.misses += 1
            if len(ids) <= self.max_tokens // 4 and piece not in self._pieces:
                self._pieces[piece] = ids
                self._size += len(ids)
                while self._size > self.max_tokens:
                    _, dropped = self._pieces.popitem(last=False)
                    self._size -= len(dropped)
        return ids
