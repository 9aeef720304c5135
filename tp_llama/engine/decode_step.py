"""Decode-only steps at static shapes: what CUDA graphs capture and torch.compile compiles once.

A decode step's rows are padded to the next bucket size (padding rows write into the spare
KV-cache block no sequence owns). Each row carries its token, position, cache index and block
table (padded to max_seq_len's blocks) as device tensors, built on the host and sent in one copy;
the cache is written in place by index and attention reads each row's blocks up to its own length
(Batch.decode_by_index). So one graph per bucket serves every mix of tables and lengths, with no
host sync inside. The step's attention block mask is built inside the graph once, for every layer.

A row carrying speculative decoding's proposals runs as one padded row per position, each with the
row's table and its own position: all positions' keys are written before any query reads them, and
each query sees its table up to its own position, so a verify step is a decode step of more rows,
with its numerics, in the bucket of its positions (proposal lengths vary; bucket shapes do not).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch
from torch import nn

from tp_llama.engine.plan import Row
from tp_llama.lora.slots import LoraStep
from tp_llama.model.batch import Batch, cache_index, padded_table, to_device
from tp_llama.model.llama4 import attention_windows

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_sizes(max_rows: int) -> tuple[int, ...]:
    return tuple(b for b in BUCKETS if b < max_rows) + (max_rows,)


class DecodeStep:
    """The model's decode-only steps, padded to buckets; compiled when asked, and on CUDA each bucket
    then captured in a CUDA graph of its own."""

    def __init__(self, model: nn.Module, max_rows: int, width: int, device: torch.device, compiled: bool,
                 lora: LoraStep | None = None):
        """lora: the adapted projections' step, where LoRA adapters are resident: each row's slot is then an
        input of the step's graph, which adds every row's adapter delta (slot 0, the base's, adds zeros)."""
        self.model, self.device, self.width, self.lora = model, device, width, lora
        self.windows = attention_windows(model)
        self.sizes = bucket_sizes(max_rows)
        cache = model.layers[0].attention.cache
        self.block_size, self.spare, self.pool_blocks = cache.block_size, cache.spare, cache.pool_blocks
        forward = self._forward
        if compiled:
            # One graph per bucket, and dynamo counts every engine's graphs of this function against
            # one limit (8 by default): past it, steps fall back to eager, far slower than compiled
            # (checks/gpu_check.py's decode speed).
            torch._dynamo.config.recompile_limit += len(self.sizes)
            torch._dynamo.config.accumulated_recompile_limit += len(self.sizes)
            forward = torch.compile(forward, dynamic=False)
        self.forward = forward
        # Captured by hand rather than by torch.compile's "reduce-overhead": a replay then costs one
        # input copy and the launch, not dynamo's guards and CUDA graph trees' checks of every weight's
        # address, which left the GPU idle for a third of each step (bench/gpu_profile.py).
        self.graphs: dict[int, Captured] = {}
        self.pool = torch.cuda.graph_pool_handle() if compiled and device.type == "cuda" else None

    def accepts(self, rows: list[Row]) -> bool:
        """A step of decode rows only, each wanting logits at its newest token and at each proposal it carries,
        their positions within the largest bucket (on an adapter only where the graph has them)."""
        return (bool(rows) and sum(len(row.tokens) for row in rows) <= self.sizes[-1]
                and all(len(row.tokens) == row.proposed + 1 and row.sample and (self.lora or not row.adapter)
                        for row in rows))

    def __call__(self, rows: list[Row]) -> torch.Tensor:
        """Logits [positions, V], each row's positions in turn (rank 0; [positions, 0] elsewhere under TP).
        On CUDA the graph's own output, which the next step overwrites."""
        positions = sum(len(row.tokens) for row in rows)
        size = next(b for b in self.sizes if b >= positions)
        host = self._inputs(rows, size)
        if self.pool is None:
            return self.forward(*self._split(to_device(host, self.device), size))[:positions]
        captured = self.graphs.get(size) or self._capture(size)
        captured.inputs.copy_(host.pin_memory(), non_blocking=True)
        captured.graph.replay()
        return captured.logits[:positions]

    def _inputs(self, rows: list[Row], size: int) -> torch.Tensor:
        """Every position's token, position, cache index, adapter slot and block table in one host tensor,
        padded to `size` positions."""
        b = self.block_size
        each = [(row, i) for row in rows for i in range(len(row.tokens))]
        pad = size - len(each)
        values = array("q", [row.tokens[i] for row, i in each] + [0] * pad)
        values += array("q", [row.start + i for row, i in each] + [0] * pad)
        values += array("q", [cache_index(row.blocks, row.start + i, b) for row, i in each] + [self.spare * b] * pad)
        values += array("q", [row.adapter for row, _ in each] + [0] * pad)
        for row in rows:
            values += array("q", padded_table(row.blocks, self.width, self.spare)) * len(row.tokens)
        values += array("q", [self.spare]) * (self.width * pad)
        # From a buffer, not a list: torch.tensor reads a list's ints one by one, which left the GPU idle
        # before a 32-row step (bench/gpu_profile.py)
        return torch.frombuffer(values, dtype=torch.long)

    def _split(self, inputs: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
        tokens, positions, locations, adapters, flat = inputs.split([size, size, size, size, size * self.width])
        return tokens, positions, locations, adapters, flat.view(size, self.width)

    def _capture(self, size: int) -> Captured:
        """The bucket's step compiled, run twice on a side stream (kernels and cuBLAS's workspaces
        ready), then captured reading a device buffer of inputs that later steps overwrite."""
        inputs = self._inputs([], size).to(self.device)  # padding rows: they write only the spare block
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward(*self._split(inputs, size))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.forward(*self._split(inputs, size))
        except RuntimeError as exc:
            raise RuntimeError(f"capturing the decode step of {size} rows in a CUDA graph failed ({exc}); "
                               "handler.compile: \"off\" serves without graphs") from exc
        self.graphs[size] = Captured(graph, inputs, logits)
        return self.graphs[size]

    @torch.inference_mode()
    def warm_up(self, sizes: tuple[int, ...] | None = None) -> None:
        """Compile (and capture) the buckets now rather than on the first requests, the largest first (the
        smaller graphs then fit in the memory it took); writes only the spare block."""
        for size in sorted(sizes or self.sizes, reverse=True):
            self([Row(0, [0], True, [self.spare])] * size)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, locations: torch.Tensor, adapters: torch.Tensor,
                 tables: torch.Tensor) -> torch.Tensor:
        if self.lora is not None:
            self.lora.rows = adapters
        return self.model(Batch.decode_by_index(tokens, positions, locations, tables, self.block_size,
                                                self.pool_blocks, self.windows))


@dataclass
class Captured:
    """One bucket's CUDA graph: the device buffer it reads its inputs from, and the logits it writes."""

    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor
    logits: torch.Tensor
