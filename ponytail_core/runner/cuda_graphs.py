"""CUDA graphs of decode steps: the whole model forward captured once per padded batch size.

A decode step of a 7B model launches over a thousand small kernels from Python; replaying a
captured graph costs one launch. Graphs read their inputs from static buffers, so a step copies
its token ids, positions, slots, block tables and lengths into those (one pinned, non-blocking
copy per tensor) and replays the graph of the smallest captured size that holds its rows. Rows
past the real ones are padding: slot -1 (nothing written) and length 0 (attention reads
nothing).

The captured kernels hold the pool's pointer table and block-id bound, which stay put while the
pool grows and shrinks (see paged_storage.py); if the table ever moves the graphs are captured
again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from .step_cache import DecodeRows, PackedStep, PackedStepCache, fill_inputs

logger = logging.getLogger("ponytail.engine")


def graph_batch_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_rows (and max_rows itself)."""
    sizes = [s for s in (1, 2, 4) if s < max_rows] + list(range(8, max_rows + 1, 8))
    if not sizes or sizes[-1] != max_rows:
        sizes.append(max_rows)
    return sorted(set(sizes))


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [1, size, vocab], written by every replay


class DecodeGraphs:
    def __init__(self, model, hf_cache: PackedStepCache, max_rows: int, max_blocks_per_seq: int):
        self.model, self.hf_cache = model, hf_cache
        self.device = hf_cache.paged.config.device
        self.sizes = graph_batch_sizes(max_rows)
        self.max_rows = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        rows, device = self.max_rows, self.device
        # Static inputs (device) and their pinned host staging buffers.
        self.input_ids = torch.zeros((rows,), dtype=torch.int64, device=device)
        self.positions = torch.zeros((rows,), dtype=torch.int64, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros((rows,), dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((rows, self.max_blocks), dtype=torch.int32, device=device)
        self._host = {name: torch.empty_like(t, device="cpu").pin_memory()
                      for name, t in self._statics().items()}
        self._staged = torch.cuda.Event()  # the last copies out of the staging buffers
        self._graphs: dict[int, _Captured] = {}
        self._pool = None
        self.replays = 0
        self._table_version = hf_cache.paged.ptr_table_version

    def _statics(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "positions": self.positions, "slots": self.slots,
                "seq_lens": self.seq_lens, "block_tables": self.block_tables}

    def size_for(self, rows: int) -> int | None:
        """The captured batch size a step of `rows` decode rows replays (None: too many rows)."""
        for size in self.sizes:
            if size >= rows:
                return size
        return None

    # -------------------------------------------------------------- capture
    def capture_all(self) -> None:
        """Capture every size, largest first, into one shared memory pool."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self._capture(size)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s..%s) in %.1f s", len(self.sizes),
                    self.sizes[0], self.sizes[-1], time.perf_counter() - start)

    def _capture(self, size: int) -> None:
        self._stage_padding()
        step = self._step(size)
        saved = self.hf_cache.step
        try:
            self.hf_cache.step = step
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up off the capturing stream (compiles, lazy inits)
                for _ in range(2):
                    self._forward(size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._forward(size)
            self._pool = graph.pool()
            self._graphs[size] = _Captured(graph, logits)
        finally:
            self.hf_cache.step = saved

    def _forward(self, size: int) -> torch.Tensor:
        out = self.model(input_ids=self.input_ids[None, :size], position_ids=self.positions[None, :size],
                         cache=self.hf_cache, use_cache=True, logits_to_keep=0)
        return out.logits

    def _step(self, size: int) -> PackedStep:
        return PackedStep(slot_mapping=self.slots[:size],
                          decode=DecodeRows(block_tables=self.block_tables[:size], seq_lens=self.seq_lens[:size]),
                          prefill=None)

    def _stage_padding(self) -> None:
        for name, tensor in self._statics().items():
            tensor.fill_(-1 if name == "slots" else 0)

    # ------------------------------------------------------------------ run
    def run(self, token_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            seq_lens: list[int], fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [rows, vocab] (the graph's own buffer: read before the next replay).

        fill: (sampled tokens, [2, n] index) on the device: input_ids[index[0]] = sampled[index[1]]
        before the replay (async scheduling: inputs the previous step sampled, see fill_inputs)."""
        rows = len(token_ids)
        size = self.size_for(rows)
        if self.hf_cache.paged.ptr_table_version != self._table_version:
            logger.warning("the KV pool's pointer table moved: capturing the decode graphs again")
            self._graphs.clear()
            self._pool = None
            self._table_version = self.hf_cache.paged.ptr_table_version
        if size not in self._graphs:
            self._capture(size)
        self._staged.synchronize()  # the previous step's copies have left the staging buffers
        host = {name: buffer[:size].numpy() for name, buffer in self._host.items()}
        for name, values, pad in (("input_ids", token_ids, 0), ("positions", positions, 0), ("slots", slots, -1),
                                  ("seq_lens", seq_lens, 0)):
            host[name][:rows] = values
            host[name][rows:] = pad
        table = host["block_tables"]
        table.fill(0)
        for row, blocks in enumerate(tables):
            table[row, : len(blocks)] = blocks
        for name, tensor in self._statics().items():
            tensor[:size].copy_(self._host[name][:size], non_blocking=True)
        self._staged.record()
        if fill is not None:
            fill_inputs(self.input_ids, *fill)
        self._graphs[size].graph.replay()
        self.replays += 1
        return self._graphs[size].logits[0, :rows]
