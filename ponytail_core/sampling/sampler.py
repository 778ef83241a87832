"""The sampler: one batched, vectorized pass from a step's logits to one token per row.

`SamplingBatch.build` turns the step's SamplingParams and token histories into per-row tensors
once; `sample` runs on the logits' device with no host sync (the caller's `.tolist()` of the
chosen tokens is the only one). Work no row needs is skipped: penalties when every row is
neutral, the top-k/top-p/min-p filters when no sampled row uses them, the random draw when every
row is greedy.

Order (vLLM v1): min_tokens mask -> grammar mask (structured outputs) -> repetition/presence/frequency penalties -> greedy argmax, or
temperature -> min_p -> top_k -> top_p -> exponential race (argmax of probs / Exp(1) noise).

Logprobs follow vLLM's default (logprobs_mode="raw_logprobs"): they are log_softmax of the raw
logits the model produced, before any penalty, temperature or filter. The sampled token's
logprob is therefore the same whatever the sampling settings.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from itertools import chain
from numbers import Integral

import numpy as np
import torch

from .params import SamplingParams

Pairs = tuple[torch.Tensor, torch.Tensor]  # (row index, token id), flat, int64, on the device


def request_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The generator the engine keeps for one request: seeded with params.seed, or None."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def _to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on device: pinned and copied without blocking when headed to CUDA."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _tensor(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _to(torch.tensor(data, dtype=dtype), device)


def _pairs(ids: list[list[int]], device: torch.device) -> tuple[Pairs, int]:
    """Flat (row, token) pairs of ragged id lists (a scatter index needing no vocab size), and
    the largest id (-1 if none). The host work is O(tokens) per step, in C loops."""
    lengths = [len(seq) for seq in ids]
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=sum(lengths))
    rows = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor(lengths))
    largest = int(flat.max()) if flat.size else -1
    return (_to(rows, device), _to(torch.from_numpy(flat), device)), largest


@dataclass
class SamplingBatch:
    """One step's sampling settings as per-row tensors; a field is None when no row needs it."""

    rows: int  # rows of the logits this batch samples
    greedy: torch.Tensor | None  # [rows] bool; None when every row or no row is greedy
    all_greedy: bool  # every row takes the argmax: no temperature, filters or random draw
    temperature: torch.Tensor | None  # [rows] float32, greedy rows hold 1; None if all greedy
    min_p: torch.Tensor | None  # [rows] float32; None when no sampled row sets min_p
    top_k: torch.Tensor | None  # [rows] int64, 0 = off; None when no sampled row sets top_k
    max_top_k: int  # largest top_k, so top-k alone needs no full sort; 0 when top_k is None
    top_p: torch.Tensor | None  # [rows] float32; None when no sampled row sets top_p < 1
    repetition_penalty: torch.Tensor | None  # [rows, 1] float32; None when every row has 1
    presence_penalty: torch.Tensor | None  # [rows, 1] float32; None when every row has 0
    frequency_penalty: torch.Tensor | None  # [rows, 1] float32; None when every row has 0
    prompt_tokens: Pairs | None  # prompt ids, only for the repetition penalty
    output_tokens: Pairs | None  # generated ids, for any penalty
    min_tokens_mask: Pairs | None  # stop/EOS tokens of rows still short of min_tokens
    generators: dict[int, torch.Generator]  # sampled rows with their own generator
    any_unseeded: bool  # some sampled row draws from the global generator
    max_logprobs: int | None  # most top logprobs a row asked for; None when no row asked
    max_token_id: int  # largest token id indexed above; must be < vocab size
    grammar_rows: torch.Tensor | None = None  # [c] int64: rows constrained by a grammar
    grammar_bitmask: torch.Tensor | None = None  # [c, ceil(vocab/32)] int32: bit t = token t allowed

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        device: torch.device | str,
        eos_token_id: int | Collection[int] | None = None,
        token_bitmask: tuple[list[int], torch.Tensor] | None = None,
    ) -> SamplingBatch:
        """Per-row tensors for one step. Row i of every list is row i of the logits.

        generators[i] must be the request's own generator when params[i].seed is set (see
        request_generator); eos_token_id (one id or several) is masked, with stop_token_ids,
        in rows that have fewer than min_tokens output tokens (unless ignore_eos). token_bitmask
        is (rows, host int32 bitmask) from sampling.grammar.token_bitmask: those rows may only
        take the tokens whose bit is set.
        """
        device = torch.device(device)
        rows = len(params)
        for name, value in (("output_token_ids", output_token_ids),
                            ("prompt_token_ids", prompt_token_ids), ("generators", generators)):
            if len(value) != rows:
                raise ValueError(f"{name} has {len(value)} rows; params has {rows}")
        greedy = [p.greedy for p in params]
        sampled = [p for p, g in zip(params, greedy) if not g]

        def column(values: list, dtype=torch.float32, shape=(-1,)) -> torch.Tensor:
            return _tensor(values, dtype, device).view(shape)

        def sampled_column(field: str, off: float, dtype=torch.float32) -> torch.Tensor | None:
            """Per-row values of field (greedy rows hold off); None when every row is off."""
            values = [off if g else getattr(p, field) for p, g in zip(params, greedy)]
            return column(values, dtype) if any(v != off for v in values) else None

        def penalty_column(field: str, off: float) -> torch.Tensor | None:
            values = [getattr(p, field) for p in params]
            return column(values, shape=(-1, 1)) if any(v != off for v in values) else None

        own = {}
        for i, (p, gen, g) in enumerate(zip(params, generators, greedy)):
            if p.seed is not None and gen is None:
                raise ValueError(f"row {i} has seed={p.seed} but no generator; "
                                 "pass request_generator(params, device), kept per request")
            if gen is not None and not g:
                if gen.device.type != device.type:
                    raise ValueError(f"row {i}'s generator is on {gen.device}, not {device}")
                own[i] = gen

        repetition = penalty_column("repetition_penalty", 1.0)
        presence = penalty_column("presence_penalty", 0.0)
        frequency = penalty_column("frequency_penalty", 0.0)
        prompt_pairs = output_pairs = mask_pairs = None
        max_ids = [-1]  # largest token id of each id list scattered into the logits
        if repetition is not None:
            prompt_pairs, largest = _pairs(prompt_token_ids, device)
            max_ids.append(largest)
        if repetition is not None or presence is not None or frequency is not None:
            output_pairs, largest = _pairs(output_token_ids, device)
            max_ids.append(largest)
        eos = ([] if eos_token_id is None else [int(eos_token_id)]
               if isinstance(eos_token_id, Integral) else sorted(eos_token_id))
        stops = [p.stop_token_ids + ([] if p.ignore_eos else eos)
                 if len(out) < p.min_tokens else [] for p, out in zip(params, output_token_ids)]
        if any(stops):
            mask_pairs, largest = _pairs(stops, device)
            max_ids.append(largest)

        top_k = [0 if g else p.top_k for p, g in zip(params, greedy)]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            rows=rows,
            greedy=column(greedy, torch.bool) if any(greedy) and sampled else None,
            all_greedy=not sampled,
            temperature=column([1.0 if g else p.temperature for p, g in zip(params, greedy)])
            if sampled else None,
            min_p=sampled_column("min_p", 0.0),
            top_k=sampled_column("top_k", 0, torch.int64),
            max_top_k=max(top_k, default=0),
            top_p=sampled_column("top_p", 1.0),
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            prompt_tokens=prompt_pairs,
            output_tokens=output_pairs,
            min_tokens_mask=mask_pairs,
            generators=own,
            any_unseeded=len(own) < len(sampled),
            max_logprobs=max(asked) if asked else None,
            max_token_id=max(max_ids),
            grammar_rows=None if token_bitmask is None else _tensor(token_bitmask[0], torch.int64, device),
            grammar_bitmask=None if token_bitmask is None else _to(token_bitmask[1], device),
        )


@dataclass
class SamplerOutput:
    """What one step sampled; every tensor stays on the logits' device."""

    token_ids: torch.Tensor  # [rows] int64, the chosen tokens
    logprobs: torch.Tensor  # [rows] float32, log_softmax(raw logits) at the chosen token
    top_logprobs: Pairs | None  # ([rows, k] float32 values, [rows, k] int64 ids) of the raw
    # distribution, k = batch.max_logprobs (rows slice their own count); None when none asked
    ranks: torch.Tensor | None  # [rows] int64, 1-based rank of the chosen token; with top_logprobs
    bad_rows: torch.Tensor  # [rows] bool: logits held NaN or +inf, or were all -inf

    def to_host(self, with_logprobs: bool) -> HostSamples:
        """Queue the copies the engine reads back (tokens, bad rows, logprobs if asked for).

        On CUDA they go to pinned memory without blocking, behind the step's own kernels, and an
        event marks their end: the host can launch the next step before it waits for them. A
        plain `.tolist()` instead would also wait for every step queued after this one.
        """
        logprobs = self.logprobs if with_logprobs else None
        top = self.top_logprobs if with_logprobs else None
        if self.token_ids.device.type != "cuda":
            return HostSamples(self.token_ids, self.bad_rows, logprobs, top, None)

        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        host = HostSamples(copy(self.token_ids), copy(self.bad_rows), copy(logprobs),
                           None if top is None else (copy(top[0]), copy(top[1])), torch.cuda.Event())
        host.copied.record()
        return host


@dataclass
class HostSamples:
    """A step's samples on (or on their way to) the host; read them after wait()."""

    token_ids: torch.Tensor  # [rows] int64
    bad_rows: torch.Tensor  # [rows] bool
    logprobs: torch.Tensor | None  # [rows] float32; None when no row asked for logprobs
    top_logprobs: Pairs | None  # as SamplerOutput.top_logprobs, on the host
    copied: torch.cuda.Event | None  # recorded after the device-to-host copies; None on the CPU

    def wait(self) -> None:
        """Block until the copies have landed (the step's one host sync)."""
        if self.copied is not None:
            self.copied.synchronize()


def apply_grammar(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """-inf, in place, at every token a constrained row's grammar does not allow (no host sync)."""
    if batch.grammar_rows is None:
        return
    vocab = logits.shape[1]
    words = batch.grammar_bitmask
    if words.shape[1] * 32 < vocab:
        raise ValueError(f"the grammar bitmask covers {words.shape[1] * 32} tokens; the logits have {vocab}")
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :vocab].bool()
    rows = batch.grammar_rows
    logits.index_put_((rows,), logits[rows].masked_fill_(~allowed, float("-inf")))


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """vLLM's penalties, in place on float32 logits.

    Repetition (HF/vLLM): a token seen in the prompt or the output has a positive logit divided
    by the penalty and a negative one multiplied. Then, OpenAI style, on output tokens only:
    logit -= frequency_penalty * count + presence_penalty * (count > 0).
    """
    if batch.output_tokens is None:
        return
    counts = torch.zeros_like(logits)
    rows, ids = batch.output_tokens
    counts.index_put_((rows, ids), torch.ones_like(ids, dtype=logits.dtype), accumulate=True)
    if batch.repetition_penalty is not None:
        seen = counts > 0
        seen.index_put_(batch.prompt_tokens, seen.new_ones(()))
        penalty = torch.where(seen, batch.repetition_penalty, 1.0)
        logits.mul_(torch.where(logits > 0, penalty.reciprocal(), penalty))
    if batch.frequency_penalty is not None:
        logits.sub_(batch.frequency_penalty * counts)
    if batch.presence_penalty is not None:
        logits.sub_(batch.presence_penalty * (counts > 0))


def apply_filters(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """min_p, then top_k, then top_p, in place on temperature-scaled float32 logits.

    min_p keeps p_i >= min_p * p_max, i.e. logit_i >= max_logit + log(min_p): no softmax needed.
    top_k alone uses topk(max_top_k); top_p sorts once. Ties at a threshold are all kept.
    """
    if batch.min_p is not None:
        floor = logits.amax(-1, keepdim=True) + batch.min_p.log().unsqueeze(1)
        logits.masked_fill_(logits < floor, float("-inf"))
    k = batch.top_k
    if batch.top_p is None:
        if k is not None:
            top = logits.topk(min(batch.max_top_k, logits.shape[1]), dim=-1).values
            kth = top.gather(1, (k.clamp(1, top.shape[1]) - 1).unsqueeze(1))
            kth.masked_fill_((k == 0).unsqueeze(1), float("-inf"))
            logits.masked_fill_(logits < kth, float("-inf"))
        return
    ordered, order = logits.sort(dim=-1)  # ascending: the most likely tokens are last
    vocab = logits.shape[1]
    if k is not None:
        k = torch.where(k == 0, vocab, k.clamp(max=vocab))
        kth = ordered.gather(1, (vocab - k).unsqueeze(1))
        ordered.masked_fill_(ordered < kth, float("-inf"))
    below = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - batch.top_p).unsqueeze(1)
    below[:, -1] = False  # always keep the most likely token
    ordered.masked_fill_(below, float("-inf"))
    logits.scatter_(1, order, ordered)


def _random_tokens(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Exponential race: argmax(p / E), E ~ Exp(1), draws token i with probability p_i.

    A row with its own generator draws its noise from it alone, so its token depends on its
    seed and its logits, not on the rest of the batch.
    """
    noise = torch.empty_like(probs)
    if batch.any_unseeded:
        noise.exponential_()
    for row, gen in batch.generators.items():
        noise[row].exponential_(generator=gen)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # 0 / 0 would make a masked token win
    return probs.div_(noise).argmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """One token per row of logits [rows, vocab]; the input tensor is not modified."""
    rows, vocab = logits.shape
    if rows != batch.rows:
        raise ValueError(f"logits have {rows} rows; the sampling batch has {batch.rows}")
    if batch.max_token_id >= vocab:
        raise ValueError(f"token id {batch.max_token_id} is outside the vocabulary of {vocab}")
    x = logits.to(torch.float32, copy=True)  # the one working copy; logits stay untouched
    bad_rows = ~torch.isfinite(x.amax(dim=-1))  # amax propagates NaN; all -inf gives -inf
    log_norm = x.logsumexp(dim=-1)
    top = None
    if batch.max_logprobs is not None:
        values, ids = x.topk(min(batch.max_logprobs, vocab), dim=-1)
        top = (values - log_norm.unsqueeze(1), ids)
    if batch.min_tokens_mask is not None:
        x.index_put_(batch.min_tokens_mask, x.new_full((), float("-inf")))  # x[...] = syncs
    apply_grammar(x, batch)
    apply_penalties(x, batch)

    if batch.all_greedy:
        tokens = x.argmax(dim=-1)
    else:
        greedy_tokens = x.argmax(dim=-1) if batch.greedy is not None else None
        x.div_(batch.temperature.unsqueeze(1))
        apply_filters(x, batch)
        tokens = _random_tokens(x.softmax(dim=-1), batch)
        if greedy_tokens is not None:
            tokens = torch.where(batch.greedy, greedy_tokens, tokens)

    chosen = logits.gather(1, tokens.unsqueeze(1))
    ranks = (logits > chosen).sum(dim=-1) + 1 if top is not None else None
    return SamplerOutput(token_ids=tokens, logprobs=chosen.squeeze(1).float() - log_norm,
                         top_logprobs=top, ranks=ranks, bad_rows=bad_rows)
