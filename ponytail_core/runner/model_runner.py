"""Runs one engine step through a stock transformers model: packed inputs in, logits out."""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from ..attention import hf_backend as hf_attention
from ..attention.chunks import SdpaShapes, equal_length_runs
from .cpu_head import prepacked_head
from .residual_handoff import check_consumed
from .step_cache import DecodeRows, PackedStep, PackedStepCache, PrefillChunks, fill_inputs
from .step_overhead import PROMPT_TOKENS, StepOverhead, measure_step_overhead
from ..config import RunnerConfig, TuningConfig
from ..errors import ConfigError, KernelError
from ..kv.paged_cache import PagedKVCache
from .inputs import ScheduledChunk
from ..utils.arith import cdiv
from ..utils.device import to_device

logger = logging.getLogger("ponytail.engine")


# warm_up's dummy steps, each a list of (context tokens, new tokens) rows: prompt chunks without
# context and chunks after one, with rows of at most and of more than 128 query tokens (FA4's tile:
# on Blackwell its kernel choice depends on which side of it the longest row falls).
WARM_UP_STEPS = (((0, 8), (0, 24)), ((0, 16), (0, 160)), ((40, 8),), ((40, 8), (24, 160)))


def warm_up_steps(max_step_tokens: int, max_model_len: int) -> list[tuple[tuple[int, int], ...]]:
    """warm_up's steps: first one of max_step_tokens new tokens (prompts of at most max_model_len),
    then those of WARM_UP_STEPS that fit max_model_len.

    The largest step goes first because inductor sizes each compiled kernel's launch configuration
    by the call that compiles it and keeps it for every later size: compiled at the small steps'
    32 tokens, the prefill steps' elementwise kernels ran well under the card's bandwidth. vLLM's
    start-up likewise runs its full token budget first."""
    starts = range(0, max_step_tokens, max_model_len)
    largest = tuple((0, min(max_model_len, max_step_tokens - start)) for start in starts)
    small = [rows for rows in WARM_UP_STEPS if max(context + new for context, new in rows) <= max_model_len]
    return ([largest] if largest else []) + small


def prompt_logit_positions(chunks: list[ScheduledChunk]) -> list[tuple[ScheduledChunk, int]]:
    """(chunk, position) for each position whose logits score the next prompt token for a
    request that asked for prompt logprobs (the last prompt position samples instead)."""
    out = []
    for chunk in chunks:
        first = chunk.request.prompt_logits_from
        if first is None:
            continue
        end = min(chunk.start + chunk.num_tokens, len(chunk.request.prompt_token_ids) - 1)
        out.extend((chunk, p) for p in range(max(chunk.start, first), end))
    return out


class ModelRunner:
    """Runs engine steps through the model, changed first as `runner` and `tuning` ask (both resolved:
    EngineConfig.resolved): column-major weights through cuBLASLt (gemm_layout.py), fused q/k/v and
    gate/up GEMMs (fused_projections.py), compiled decoder layers (compile.py), captured decode graphs
    (cuda_graphs.py). max_step_tokens: the most tokens the scheduler puts in one step, the warm-up's
    first step (warm_up_steps)."""

    def __init__(self, model, cache: PagedKVCache, runner: RunnerConfig, tuning: TuningConfig, *,
                 max_num_seqs: int, max_model_len: int, max_step_tokens: int = 0):
        self.model = model
        self.device = cache.config.device
        self.max_model_len = max_model_len
        self.max_step_tokens = max_step_tokens
        hf_attention.switch_model(model, keep_fallback=False)  # the engine owns the model: plain masks only
        if tuning.column_major_weights:  # before fusing, compiling and capture: all three keep or record the layout
            from .gemm_layout import column_major_weights as relayout, forward_through_cublaslt

            relayout(model)
            if self.device.type == "cuda":
                forward_through_cublaslt(model)
        if tuning.fuse_projections:
            from .fused_projections import fuse_projections as fuse

            fuse(model)  # before compiling and capture: both record the fused GEMMs
        if runner.compile_model:
            from .compile import compile_decoder_layers

            compile_decoder_layers(model)  # before capture: the graphs record the fused kernels
        self.hf_cache = PackedStepCache(cache, runner.prefill_attention or "flash")
        self.block_size = cache.config.block_size
        self.sdpa_shapes = SdpaShapes()  # prefill run shapes seen: SDPA (cuDNN plans) only for recurring ones
        # On the CPU the vocabulary projection runs through oneDNN with its weight reordered once (cpu_head.py).
        self.head = prepacked_head(model) if self.device.type == "cpu" else None
        self.graphs = None
        self.step_overhead: StepOverhead | None = None  # with graphs: what the scheduler's prefill delay weighs
        if self.device.type == "cuda":
            self.warm_up()
        if runner.cuda_graphs:
            from .cuda_graphs import DecodeGraphs

            with torch.inference_mode():
                self.graphs = DecodeGraphs(model, self.hf_cache, max_num_seqs, cdiv(max_model_len, self.block_size))
                self.graphs.capture_all()
                self.step_overhead = self._measure_step_overhead()

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Compute every chunk's tokens; returns float32 logits [sampling chunks, vocab] in chunk order,
        then (only when some chunk's request asked for prompt logprobs) one row per position in
        prompt_logit_positions(chunks), in that order.

        sampled: the previous step's sampled tokens, still on the device (async scheduling). A
        chunk whose request has a pending_row ends with a placeholder; its input is
        sampled[pending_row], gathered on the device (the host never waits for it).
        """
        decode = [c for c in chunks if c.num_tokens == 1]
        prefill = [c for c in chunks if c.num_tokens > 1]
        ordered = decode + prefill  # the packed layout PackedStepCache expects
        offsets = {}
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        fill_at: list[int] = []  # packed positions whose token comes from `sampled`
        fill_rows: list[int] = []  # ... and its row there
        for chunk in ordered:
            offsets[id(chunk)] = len(input_ids)
            end = chunk.start + chunk.num_tokens
            input_ids.extend(chunk.request.token_slice(chunk.start, end))
            positions.extend(range(chunk.start, end))
            slots.extend(chunk.slots)
            if chunk.request.pending_row is not None and chunk.samples:
                input_ids[-1] = 0  # the placeholder: the real token is on the device only
                fill_at.append(len(input_ids) - 1)
                fill_rows.append(chunk.request.pending_row)
        fill = None
        if fill_at:
            if sampled is None:
                raise ValueError(f"{len(fill_at)} chunks end with a placeholder token but no sampled tokens were given")
            fill = (sampled, self._tensor([fill_at, fill_rows], torch.int64))
        sample_at = [offsets[id(c)] + c.num_tokens - 1 for c in chunks if c.samples]
        prompt_at = [offsets[id(c)] + p - c.start for c, p in prompt_logit_positions(chunks)]
        paged = self.hf_cache.paged
        tables = [paged.block_table(c.request.request_id, c.start + c.num_tokens) for c in ordered]
        sample_at += prompt_at  # never the same position: prompt ones precede each sampling one
        if not prefill and not prompt_at and self.graphs is not None and self.graphs.size_for(len(decode)) is not None:
            logits = self.graphs.run(input_ids, positions, slots, tables, [p + 1 for p in positions], fill=fill)
            return self._pick(logits, sample_at).float()
        self.hf_cache.step = PackedStep(
            slot_mapping=self._tensor(slots, torch.int64),
            decode=self._decode_rows(decode, tables[: len(decode)]),
            prefill=self._prefill_chunks([(c.start, c.num_tokens) for c in prefill], tables[len(decode) :],
                                         start=len(decode)))
        ids = self._tensor(input_ids, torch.int64)
        if fill is not None:
            fill_inputs(ids, *fill)
        return self._forward(ids, positions, sample_at).float()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Runs the model over warm_up_steps' dummy prompt chunks, writing nothing to the cache (every
        slot is -1; context rows read block 0), so that what compiles at its first call compiles here,
        in LLM(), instead of inside the first requests' steps: FlashAttention-4's kernels (5-10 s
        each) and the compiled layers' prompt shapes, tuned at the largest step. A kernel that fails
        here fails at start-up, naming the setting that chose it, rather than failing requests."""
        started = time.perf_counter()
        for rows in warm_up_steps(self.max_step_tokens, self.max_model_len):
            positions = [p for context, new in rows for p in range(context, context + new)]
            tables = [[0] * cdiv(context + new, self.block_size) for context, new in rows]
            self.hf_cache.step = PackedStep(slot_mapping=self._tensor([-1] * len(positions), torch.int64), decode=None,
                                            prefill=self._prefill_chunks(list(rows), tables, start=0, sdpa=False))
            try:
                self._forward(self._tensor([0] * len(positions), torch.int64), positions, [len(positions) - 1])
            except torch.OutOfMemoryError as error:  # the device, not a kernel: name the budgets that size a step
                raise ConfigError(f"the start-up warm-up step of {len(positions)} prompt tokens (the most one step "
                                  f"may hold) ran out of device memory: {str(error).splitlines()[0]}; lower "
                                  "max_num_batched_tokens / prefill_only_batched_tokens, or free device memory"
                                  ) from error
            except Exception as error:
                varlen = self.hf_cache.prefill_varlen
                hint = "; prefill_attention='flash' takes torch's FlashAttention-2 instead" if varlen == "fa4" else ""
                raise KernelError(f"the start-up warm-up step over dummy prompt chunks failed (prefill_attention="
                                  f"{varlen!r}): {type(error).__name__}: {error}{hint}") from error
            finally:
                self.hf_cache.step = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("warm-up over dummy prompt chunks (prompt attention %r) in %.1f s",
                    self.hf_cache.prefill_varlen, time.perf_counter() - started)

    def _measure_step_overhead(self) -> StepOverhead:
        """An eager step of n dummy decode rows and a PROMPT_TOKENS chunk against the replay of the
        n rows, at 1 row and at the largest graph (step_overhead.py). Every slot is -1: nothing is
        written to the pool; the rows read block 0."""
        def eager(n: int) -> None:
            self.hf_cache.step = PackedStep(
                slot_mapping=self._tensor([-1] * (n + PROMPT_TOKENS), torch.int64),
                decode=DecodeRows(block_tables=self._table([[0]] * n), seq_lens=self._tensor([1] * n, torch.int32)),
                prefill=self._prefill_chunks([(0, PROMPT_TOKENS)], [[0] * cdiv(PROMPT_TOKENS, self.block_size)],
                                             start=n, sdpa=False))
            try:
                self._forward(self._tensor([0] * (n + PROMPT_TOKENS), torch.int64),
                              [0] * n + list(range(PROMPT_TOKENS)), list(range(n)) + [n + PROMPT_TOKENS - 1])
            finally:
                self.hf_cache.step = None

        def replay(n: int) -> None:
            self.graphs.run([0] * n, [0] * n, [-1] * n, [[0]] * n, [1] * n)

        overhead = measure_step_overhead(eager, replay, rows=(1, self.graphs.max_rows),
                                         sync=lambda: torch.cuda.synchronize(self.device))
        self.graphs.replays = 0  # the count is the requests' replays
        logger.info("a step with a prompt chunk costs %s more than a decode step's graph replay", overhead.describe())
        return overhead

    def _forward(self, ids: torch.Tensor, positions: list[int], sample_at: list[int]) -> torch.Tensor:
        with self.head.active() if self.head is not None else contextlib.nullcontext():
            out = self.model(input_ids=ids[None], position_ids=self._tensor(positions, torch.int64)[None],
                             cache=self.hf_cache, use_cache=True,
                             logits_to_keep=self._tensor(sample_at, torch.int64))
        check_consumed(self.model)
        return out.logits[0]

    def _pick(self, logits: torch.Tensor, sample_at: list[int]) -> torch.Tensor:
        if sample_at == list(range(len(sample_at))):
            return logits[: len(sample_at)]
        return logits[self._tensor(sample_at, torch.int64)]  # pinned copy: no host sync

    def _decode_rows(self, members: list[ScheduledChunk], tables: list[list[int]]) -> DecodeRows | None:
        if not members:
            return None
        return DecodeRows(block_tables=self._table(tables),
                          seq_lens=self._tensor([c.start + 1 for c in members], torch.int32))

    def _prefill_chunks(self, rows: list[tuple[int, int]], tables: list[list[int]], start: int,
                        sdpa: bool = True) -> PrefillChunks | None:
        """rows: each chunk's (context tokens, new tokens). sdpa=False: varlen only, shapes not counted."""
        if not rows:
            return None
        cu = [0]
        for _, new in rows:
            cu.append(cu[-1] + new)
        runs = equal_length_runs([new for _, new in rows]) if all(context == 0 for context, _ in rows) else None
        seq_lens = [context + new for context, new in rows]
        return PrefillChunks(start=start, cu_seq_q=self._tensor(cu, torch.int32),
                             max_query_len=max(new for _, new in rows), block_tables=self._table(tables),
                             seq_lens=self._tensor(seq_lens, torch.int32), num_keys=sum(seq_lens),
                             runs=runs, sdpa=sdpa and runs is not None and self.sdpa_shapes.recurring(runs))

    def _table(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(t) for t in tables))
        return self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32)

    def _tensor(self, values, dtype) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype), self.device)  # one pinned copy per tensor
