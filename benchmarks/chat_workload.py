"""The multi-turn chat workload of bench_router.py: where prefix caching across replicas shows.

Sessions share a few long system prompts; each next turn sends the whole conversation so far (the
previous prompt, the answer the server gave, a new user message), so a turn's prompt extends the
previous one's. A session sends its turns one after another (with `think_s` between them); new
sessions start `session_gap_s` apart and run concurrently. Requests go through the OpenAI chat
API as messages, as a chat client sends them: the engine applies the chat template.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import openai

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]


@dataclass(slots=True, frozen=True)
class ChatShape:
    sessions: int  # conversations
    turns: int  # user messages per conversation
    system_prompts: int  # distinct system prompts, shared round-robin across sessions
    system_words: int  # words per system prompt (~1-2 tokens each)
    user_words: int  # words per user message
    max_tokens: int  # per answer (ignore_eos: every answer has this many tokens)
    session_gap_s: float  # between session starts
    think_s: float  # between a session's answer and its next turn

    @property
    def context_tokens(self) -> int:
        """A rough upper bound of a session's last prompt + answer, in tokens (2 per word)."""
        return 2 * (self.system_words + self.turns * self.user_words) + self.turns * self.max_tokens + 32


@dataclass(slots=True, frozen=True)
class Session:
    system: str
    users: tuple[str, ...]  # one message per turn


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def sessions(shape: ChatShape, seed: int) -> list[Session]:
    rng = random.Random(seed)
    systems = [f"System prompt {i}: " + words(rng, shape.system_words) for i in range(shape.system_prompts)]
    return [Session(system=systems[i % len(systems)],
                    users=tuple(f"Turn {t} of session {i}: " + words(rng, shape.user_words) for t in range(shape.turns)))
            for i in range(shape.sessions)]


def run_chat(base_url: str, model: str, conversations: list[Session], shape: ChatShape) -> dict:
    """Every session's turns against one app: per request TTFT, tokens and end time."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    results: list[dict] = []
    lock = threading.Lock()

    def one_session(session: Session) -> None:
        messages = [{"role": "system", "content": session.system}]
        for turn, user in enumerate(session.users):
            if turn:
                time.sleep(shape.think_s)
            messages.append({"role": "user", "content": user})
            start = time.perf_counter()
            first, text, tokens = None, [], 0
            try:
                stream = client.chat.completions.create(model=model, messages=messages, max_tokens=shape.max_tokens,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True},
                                                        extra_body={"ignore_eos": True})
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        if first is None:
                            first = time.perf_counter() - start
                        text.append(chunk.choices[0].delta.content)
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                result = {"ok": True, "ttft": first, "end": time.perf_counter(), "tokens": tokens, "turn": turn}
            except Exception as exc:  # counted as a failure, not hidden; the session stops here
                result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200]}
            with lock:
                results.append(result)
            if not result["ok"]:
                return
            messages.append({"role": "assistant", "content": "".join(text)})

    threads = []
    t0 = time.perf_counter()
    for index, session in enumerate(conversations):
        if index:
            time.sleep(shape.session_gap_s)
        thread = threading.Thread(target=one_session, args=(session,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout=1800)
    done = [r for r in results if r["ok"]]
    requests = len(conversations) * shape.turns
    elapsed = max((r["end"] for r in done), default=time.perf_counter()) - t0
    ttfts = sorted(r["ttft"] for r in done if r["ttft"] is not None)
    return {"requests": requests, "failed": requests - len(done),
            "errors": [r["error"] for r in results if not r["ok"]][:3],
            "tokens": sum(r["tokens"] for r in done), "tokens_per_s": sum(r["tokens"] for r in done) / elapsed,
            "seconds": elapsed, "ttfts": ttfts, "ttfts_long": [], "ttft_mean": sum(ttfts) / len(ttfts) if ttfts else None}
