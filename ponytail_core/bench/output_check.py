"""Are Ponytail's greedy outputs the model's? Checked against plain `model.generate` and an fp32
reference, before any speed is quoted (`ponytail bench` and benchmarks/bench_engine.py).

Both sides decode greedily on their own. In bf16 the two paths round differently, so where the
model's top two tokens are nearly tied a side may pick the other one, and from there on the two
continuations differ: comparing them token by token would fail an honest engine. Instead each
side's continuation is teacher-forced through the model in float32 (weights cast in place and
back, which is exact), and every token a side chose is judged on its own prefix:

- the reference's argmax: exact;
- otherwise a near tie when the reference puts it within `tolerance` logits of its best token,
  and wrong beyond that.

`tolerance` is the dtype's noise, measured and bounded below: three times the largest error plain
generate's own logit differences show against the reference on the same inputs (a flip needs the
error to exceed the gap; Ponytail's kernels may round somewhat more than SDPA's), and at least two
units in the last place of the dtype at the size of the reference's top logit. A near tie therefore cannot fail the check, while a wrong
token (a far-off logit, the usual sign of a bug) cannot pass it. In float32 the tolerance is a few
millionths of a logit, so there the check asks for the same tokens.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..sampling.params import MAX_LOGPROBS, SamplingParams

ULPS = 2  # the tolerance's floor, in units in the last place of the top logit
NOISE_MARGIN = 3.0  # the tolerance's measured part: this times plain generate's largest error


@dataclass(frozen=True, slots=True)
class Flip:
    """A step where a side did not choose the fp32 reference's top token."""

    row: int  # request in the sample
    step: int  # output token index
    chosen: int  # the side's token
    best: int  # the reference's argmax on the same prefix
    gap: float  # reference logit of best minus that of chosen (> 0)


@dataclass(frozen=True, slots=True)
class SideCheck:
    """One side's greedy continuation judged against the fp32 reference."""

    tokens: list[list[int]]  # greedy tokens, one list per request
    exact_steps: int  # steps whose token is the reference's argmax
    near_ties: list[Flip]  # another token, within the tolerance: honest rounding
    wrong: list[Flip]  # another token, beyond the tolerance
    logit_error: float  # largest error of this side's logit differences against fp32's


@dataclass(frozen=True, slots=True)
class OutputCheck:
    requests: int  # requests in the sample
    steps: int  # greedy tokens per request
    dtype: str  # the model's dtype
    tolerance: float  # logits: a differing choice within this of the best is a near tie
    plain: SideCheck | None  # None when steps == 0
    ponytail: SideCheck | None
    same_tokens: int = 0  # steps where Ponytail and plain generate chose the same token
    first_difference: list[int | None] = field(default_factory=list)  # per request: step, or None

    @property
    def checked(self) -> bool:
        return self.ponytail is not None

    @property
    def passed(self) -> bool:
        """No wrong token (vacuously true when nothing was checked: see `checked`)."""
        return self.ponytail is None or not self.ponytail.wrong

    def to_dict(self) -> dict:
        """JSON-ready: the verdict, the counts and every flip."""
        def side(check: SideCheck | None) -> dict | None:
            if check is None:
                return None
            return {"exact_steps": check.exact_steps, "near_ties": [asdict(f) for f in check.near_ties],
                    "wrong": [asdict(f) for f in check.wrong], "logit_error": check.logit_error}

        return {"checked": self.checked, "passed": self.passed, "requests": self.requests, "steps": self.steps,
                "of": self.requests * self.steps, "dtype": self.dtype, "tolerance": self.tolerance,
                "ponytail": side(self.ponytail), "plain": side(self.plain), "same_tokens": self.same_tokens,
                "first_difference": self.first_difference}

    def summary(self) -> str:
        if not self.checked:
            return "output check: skipped (--check-tokens 0): speeds below are not backed by a correctness check"
        total = self.requests * self.steps
        p = self.ponytail
        verdict = "PASS" if self.passed else "FAIL"
        lines = [f"output check: {verdict}: {self.requests} requests x {self.steps} greedy tokens, {self.dtype}, "
                 f"each token judged on its own prefix by the model in float32 "
                 f"(near tie: within {self.tolerance:.3g} logits of the best)",
                 f"  ponytail:       {p.exact_steps}/{total} the reference's top token, {len(p.near_ties)} near ties, "
                 f"{len(p.wrong)} wrong; largest logit error {p.logit_error:.3g}",
                 f"  plain generate: {self.plain.exact_steps}/{total} the reference's top token, "
                 f"{len(self.plain.near_ties)} near ties; largest logit error {self.plain.logit_error:.3g}",
                 f"  same token as plain generate at {self.same_tokens}/{total} steps; first difference per "
                 f"request: {self.first_difference}"]
        for flip in p.wrong[:5]:
            lines.append(f"  WRONG: request {flip.row} step {flip.step}: ponytail chose {flip.chosen}, the "
                         f"reference's best is {flip.best}, {flip.gap:.3g} logits higher")
        return "\n".join(lines)


def check_outputs(model, prompts: list[list[int]], steps: int,
                  generate: Callable[[list[list[int]], SamplingParams], list[Any]]) -> OutputCheck:
    """Ponytail against plain generate on `prompts`, `steps` greedy tokens each.

    generate(prompts, params): builds a `ponytail.LLM` over this same model, returns its
    `generate` outputs and keeps no engine: the weights are cast to float32 afterwards, and an
    engine's CUDA graphs (or compiled layers) would still point at the weights it was built with.
    Leaves the model as it came (dtype, attention implementation).
    """
    dtype = next(model.parameters()).dtype
    dtype_name = str(dtype).removeprefix("torch.")
    if steps <= 0 or not prompts:
        return OutputCheck(len(prompts), 0, dtype_name, 0.0, None, None)
    with attention(model, "sdpa"):
        plain_tokens, plain_logits = plain_greedy(model, prompts, steps)
    outputs = generate(prompts, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True,
                                               logprobs=MAX_LOGPROBS))
    _release_memory(model)
    ours = [list(o.token_ids) for o in outputs]
    our_scores = [_logprob_rows(o.outputs[0].logprobs) for o in outputs]
    with float32_weights(model), attention(model, "sdpa"):
        ref_plain = reference_logits(model, prompts, plain_tokens)
        ref_ours = reference_logits(model, prompts, ours)
    plain_error = max(logit_error(t, s, r) for t, s, r in zip(plain_tokens, plain_logits, ref_plain))
    top = max(r.max().abs().item() for r in ref_plain + ref_ours)
    floor = ULPS * torch.finfo(dtype).eps * max(1.0, top)
    tolerance = max(NOISE_MARGIN * plain_error, floor)
    plain = judge(plain_tokens, ref_plain, tolerance, plain_error)
    ponytail = judge(ours, ref_ours, tolerance,
                     max(logit_error(t, s, r) for t, s, r in zip(ours, our_scores, ref_ours)))
    same = [sum(a == b for a, b in zip(x, y)) for x, y in zip(ours, plain_tokens)]
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ours, plain_tokens)]
    return OutputCheck(len(prompts), steps, dtype_name, tolerance, plain, ponytail, sum(same), first)


def plain_greedy(model, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Plain generate's greedy tokens and its logits ([steps, vocab] float32 on the CPU) per
    request, one request at a time (no padding to account for)."""
    device = next(model.parameters()).device
    tokens, logits = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        tokens.append(out.sequences[0, ids.shape[1]:].tolist())
        logits.append(torch.stack([step[0] for step in out.logits]).float().cpu())
    return tokens, logits


@torch.inference_mode()
def reference_logits(model, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
    """Per request, the model's logits ([steps, vocab] float32, CPU) for every continuation token,
    given the prompt and the continuation before it: one forward pass, no cache."""
    device = next(model.parameters()).device
    result = []
    for prompt, tokens in zip(prompts, continuations):
        ids = torch.tensor([prompt + tokens[:-1]], device=device)
        out = model(input_ids=ids, use_cache=False, logits_to_keep=len(tokens))
        result.append(out.logits[0].float().cpu())
    return result


def judge(tokens: list[list[int]], reference: list[torch.Tensor], tolerance: float,
          error: float) -> SideCheck:
    """Sort every chosen token into exact, near tie (within tolerance of the best) or wrong."""
    exact, near, wrong = 0, [], []
    for row, (chosen_row, ref) in enumerate(zip(tokens, reference)):
        best_values, best_ids = ref.max(dim=-1)
        for step, chosen in enumerate(chosen_row):
            best = int(best_ids[step])
            gap = float(best_values[step] - ref[step, chosen])
            if chosen == best or gap <= 0:  # gap 0: a tie in float32 itself
                exact += 1
            else:
                (near if gap <= tolerance else wrong).append(Flip(row, step, chosen, best, gap))
    return SideCheck(tokens, exact, near, wrong, error)


def logit_error(tokens: list[int], scores, reference: torch.Tensor) -> float:
    """Largest error of a side's logit differences against the reference: per step, for the
    tokens the side scored (all of them for a logits tensor, its top logprobs for a list of
    dicts), |(s[j] - s[c]) - (r[j] - r[c])| with c the chosen token. Differences, because
    logprobs are logits shifted by a constant per step."""
    worst = 0.0
    for step, chosen in enumerate(tokens):
        ref = reference[step]
        if isinstance(scores, torch.Tensor):
            ids = torch.topk(ref, min(MAX_LOGPROBS, ref.numel())).indices
            values = scores[step, ids]
            base = scores[step, chosen]
        else:
            ids = torch.tensor(list(scores[step]))
            values = torch.tensor(list(scores[step].values()))
            base = scores[step][chosen]
        err = ((values - base) - (ref[ids] - ref[chosen])).abs().max()
        worst = max(worst, float(err))
    return worst


def _logprob_rows(logprobs) -> list[dict[int, float]]:
    if logprobs is None:
        raise RuntimeError("the engine returned no logprobs; the output check needs them")
    return logprobs


@contextlib.contextmanager
def attention(model, implementation: str) -> Iterator[None]:
    """Run the model with another attention implementation, then put the previous one back."""
    previous = getattr(model.config, "_attn_implementation", None)
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        if previous is not None and previous != implementation:
            model.set_attn_implementation(previous)


@contextlib.contextmanager
def float32_weights(model) -> Iterator[None]:
    """Give every floating parameter and buffer a float32 copy while inside, and its own storage back
    afterwards (each tensor keeps its dtype: rotary buffers are often float32 in a bf16 model).

    The originals stay allocated meanwhile (1.5x the weights for a moment) rather than being cast
    back: new bf16 tensors carved out of the freed float32 blocks strand about the weights' size in
    half-used allocator segments that empty_cache cannot return, and an engine built afterwards
    (which sizes its KV pool by what the device has free) would start ~13 GB short on a 7B.
    """
    tensors = [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]
    original = [(t, t.data) for t in tensors if t.is_floating_point() and t.dtype != torch.float32]
    for t, data in original:
        t.data = data.float()
    try:
        yield
    finally:
        for t, data in original:
            t.data = data
        _release_memory(model)


def _release_memory(model) -> None:
    gc.collect()  # an engine's pool and graphs, or float32 weights, go before the next step
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.empty_cache()
