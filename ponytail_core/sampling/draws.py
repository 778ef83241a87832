"""From a step's working logits to the sampled rows' tokens: the min_p / top_k / top_p filters and
the random draw. On CUDA a full sort for top_p and vLLM's exponential race; on the CPU, where both
are slow (a sort of 64 x 49,152 took 178 ms, Exp(1) noise for 256 rows 313 ms), the nucleus is
looked for among each row's most likely tokens and each row takes one uniform draw.
"""

from __future__ import annotations

import torch

from .batch import SamplingBatch


def apply_filters(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """min_p, then top_k, then top_p, in place on temperature-scaled float32 logits.

    min_p keeps p_i >= min_p * p_max, i.e. logit_i >= max_logit + log(min_p): no softmax needed.
    top_k alone uses topk(max_top_k); top_p sorts once on CUDA, and on the CPU looks at each row's
    most likely tokens first (_top_p_from_candidates). Ties at a top_k threshold are all kept.
    """
    if batch.min_p is not None:
        floor = logits.amax(-1, keepdim=True) + batch.min_p.log().unsqueeze(1)
        logits.masked_fill_(logits < floor, float("-inf"))
    k = batch.top_k
    if batch.top_p is None or logits.device.type == "cpu":
        if k is not None:
            top = logits.topk(min(batch.max_top_k, logits.shape[1]), dim=-1).values
            kth = top.gather(1, (k.clamp(1, top.shape[1]) - 1).unsqueeze(1))
            kth.masked_fill_((k == 0).unsqueeze(1), float("-inf"))
            logits.masked_fill_(logits < kth, float("-inf"))
        if batch.top_p is not None:
            _top_p_from_candidates(logits, batch.top_p)
        return
    top_k_top_p_sorted(logits, k, batch.top_p)


def top_k_top_p_sorted(logits: torch.Tensor, k: torch.Tensor | None, top_p: torch.Tensor) -> None:
    """top_k then top_p over a full sort of each row (the CUDA path; the CPU's fallback)."""
    ordered, order = logits.sort(dim=-1)  # ascending: the most likely tokens are last
    vocab = logits.shape[1]
    if k is not None:
        k = torch.where(k == 0, vocab, k.clamp(max=vocab))
        kth = ordered.gather(1, (vocab - k).unsqueeze(1))
        ordered.masked_fill_(ordered < kth, float("-inf"))
    below = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p).unsqueeze(1)
    below[:, -1] = False  # always keep the most likely token
    ordered.masked_fill_(below, float("-inf"))
    logits.scatter_(1, order, ordered)


TOP_P_CANDIDATES = 1024  # tokens per row the CPU's top_p looks at before it sorts a whole row


def _top_p_from_candidates(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """top_p among each row's TOP_P_CANDIDATES most likely tokens, exact where they hold at least
    top_p of the row's probability (so the nucleus is among them); other rows sort in full.

    A full sort of 64 rows x 49,152 took 178 ms on the CPU, topk(1024) 21 ms. A token is kept when
    the probability of the tokens before it (most likely first) is below top_p, as the sort path's
    "drop the least likely tokens whose total is at most 1 - top_p"."""
    vocab = logits.shape[1]
    values, ids = logits.softmax(dim=-1).topk(min(TOP_P_CANDIDATES, vocab), dim=-1)  # most likely first
    before = values.cumsum(dim=-1) - values  # mass of the more likely candidates
    keep = before < top_p.unsqueeze(1)
    keep[:, 0] = True  # always keep the most likely token
    drop = torch.ones_like(logits, dtype=torch.bool).scatter_(1, ids, ~keep)
    wide = (~(before[:, -1] + values[:, -1] >= top_p)).nonzero().flatten()  # nucleus wider than the candidates
    if wide.numel():  # these rows sort in full
        rows = logits.index_select(0, wide)
        top_k_top_p_sorted(rows, None, top_p.index_select(0, wide))
        logits.index_copy_(0, wide, rows)
        drop.index_fill_(0, wide, False)
    logits.masked_fill_(drop, float("-inf"))


def random_tokens(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Token i with probability p_i, per row. A row with its own generator draws from it alone,
    so its token depends on its seed and its logits, not on the rest of the batch."""
    if probs.device.type == "cpu":
        return _inverse_cdf_tokens(probs, batch)
    # Exponential race (vLLM's): argmax(p / E), E ~ Exp(1); no sort, no host sync.
    noise = torch.empty_like(probs)
    if batch.any_unseeded:
        noise.exponential_()
    for row, gen in batch.generators.items():
        noise[row].exponential_(generator=gen)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # 0 / 0 would make a masked token win
    return probs.div_(noise).argmax(dim=-1)


def _inverse_cdf_tokens(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One uniform draw per row against the row's cumulative probabilities (float64).

    The CPU's exponential_ is single-threaded: noise for 256 rows x 49,152 tokens took 313 ms a
    step, this 43 ms. A token of probability 0 never wins: its cumulative sum equals the one
    before it, and the pick is the first position whose sum exceeds the draw."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    total = cdf[:, -1:]
    draw = torch.empty_like(total)
    if batch.any_unseeded:
        draw.uniform_()
    for row, gen in batch.generators.items():
        draw[row].uniform_(generator=gen)
    # Below the total even where u * total rounds up to it: a position always exceeds the draw.
    draw = torch.minimum(draw * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, draw, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
