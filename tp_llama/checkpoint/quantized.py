"""What a rank reads of each of Meta's checkpoint formats (checkpoint.formats), and what it makes of it.

`Layout` gives every tensor of the files its full shape, the dtype the rank reads it into and its shard
dim, and after a block is read puts the quantized parts into the model:

- int4: each linear of the layers becomes a LocalLinear holding a kernels.meta_int4.Int4Weight (its
  slices of the values, scales, zeros and adaptor), which runs Meta's 8da4w matmul with or without a
  serving backend; a row-parallel one (wo, w2) under TP learns the whole row's range of each token
  from the other ranks (`GroupAcross`). The embedding table is dequantized into the serving dtype, as
  Meta's reference loader does (int8 times its scales), and so is the output layer, but where the C
  kernels run it: there it keeps its int8 values (kernels.meta_int4.int8_tiles).
- fp8: each float8 feed-forward weight is multiplied by its row scales (fp8_scales_N.pt, per file
  shard) into the serving dtype, or, on a CUDA GPU with float8 matmuls, kept in float8 as an
  Fp8Weight with one scale per row of each file's k slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from tp_llama.checkpoint.formats import (FP8, INT8_TABLES, LINEARS, ROW_PARALLEL, CheckpointFormat, TensorSpec,
                                         check_int4_file, int4_specs, table_scale_spec)
from tp_llama.checkpoint.shards import check_float_dtypes, load_shard
from tp_llama.errors import CheckpointError
from tp_llama.kernels.fp8 import Fp8Weight, fp8_matmuls
from tp_llama.kernels.meta_int4 import Int4Weight, check_int4, dequantize_rows, int8_tiles
from tp_llama.model import ModelArgs, Transformer
from tp_llama.parallel.layout import NONE, full_shapes, shard_dim, tp_sharding
from tp_llama.parallel.modules import LocalLinear, all_gather_last_dim


class GroupAcross:
    """kernels.meta_int4.Across over a process group: a row's range and its parts from every rank."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def row_range(self, bounds: torch.Tensor) -> torch.Tensor:
        host = bounds.cpu() if bounds.is_cuda and dist.get_backend(self.group) == "gloo" else bounds
        dist.all_reduce(host, op=dist.ReduceOp.MAX, group=self.group)
        return host.to(bounds.device)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        rows, k = x.shape
        return all_gather_last_dim(x, self.group).view(rows, self.size, k).transpose(0, 1)


def quantized_module(weight: Int4Weight | Fp8Weight, comm: str, group: dist.ProcessGroup | None) -> LocalLinear:
    """A LocalLinear whose weight is a quantized one (a module attribute, not a parameter)."""
    module = LocalLinear(torch.empty(0), comm, group)
    del module.weight
    module.weight = weight
    return module


def _module(key: str) -> tuple[str, str]:
    """("layers.3.feed_forward.w2", "feed_forward.w2") for "layers.3.feed_forward.w2.weight"."""
    base = key.removesuffix(".weight")
    return base, ".".join(base.split(".")[2:]) if base.startswith("layers.") else base


@dataclass
class Layout:
    """Every tensor a rank reads (`specs`), the check each file's tensors get when opened, and what the
    format makes of a block once read (`assemble`)."""

    args: ModelArgs
    fmt: CheckpointFormat
    specs: dict[str, TensorSpec]
    dtype: torch.dtype
    device: torch.device
    c_kernels: bool = False  # the C kernels run the matmuls: an int8 output layer goes into their pair tiles
    fp8_keys: set[str] = field(default_factory=set)
    _fp8_tables: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def build(cls, args: ModelArgs, fmt: CheckpointFormat, paths: list[Path], tp: int, dtype: torch.dtype,
              device: torch.device, c_kernels: bool = False) -> Layout:
        full = full_shapes(args)
        dims = {key: shard_dim(key, args.family) for key in full}
        specs = {key: TensorSpec(shape, dtype, dims[key]) for key, shape in full.items()}
        layout = cls(args, fmt, specs, dtype, device, c_kernels)
        if fmt.kind == "int4":
            first = load_shard(paths[0])
            specs = {**specs, **int4_specs(args, fmt, full, dims, set(first), paths[0])}
            for table in INT8_TABLES:
                key = f"{table}.scales"
                specs[key] = table_scale_spec(specs[key], tuple(first[key].shape), full[f"{table}.weight"],
                                              len(paths), paths[0], key)
            layout.specs = specs
            layout._check_int4_tp(tp)
        elif fmt.kind == "fp8":
            first = load_shard(paths[0])
            layout.fp8_keys = {key for key in full if key in first and first[key].dtype == FP8}
            if not layout.fp8_keys:
                raise CheckpointError(f"{paths[0]}: no float8 tensor, yet {fmt.fp8_scales[0].name} is beside it")
            for key in layout.fp8_keys:
                if not key.startswith("layers.") or _module(key)[1] not in LINEARS:
                    raise CheckpointError(f"{paths[0]}: tensor {key!r} is float8: only the layers' linears may be")
                read_as = FP8 if fp8_matmuls(device) else torch.float32
                layout.specs[key] = TensorSpec(full[key], read_as, dims[key])
        return layout

    def _check_int4_tp(self, tp: int) -> None:
        """Under TP a row-parallel layer's groups split with its k, and SpinQuant's Hadamard transform
        spans ranks only as a butterfly over a power of two of them."""
        for key, spec in self.specs.items():
            if key.endswith(".scales") and spec.dim == 1 and len(spec.full) == 2 and spec.full[1] % tp:
                raise CheckpointError(
                    f"tensor-parallel size {tp} splits the groups of {key.removesuffix('.scales')}: its k holds "
                    f"{spec.full[1]} groups of {self.fmt.group}, which {tp} ranks cannot share whole")
        ffn = self.args.ffn_dim
        if self.fmt.hadamard and (ffn & (ffn - 1) or tp & (tp - 1)):
            raise CheckpointError(
                f"SpinQuant's Hadamard transform on w2's input needs a power of two for the FFN width ({ffn}) and "
                f"the tensor-parallel size ({tp}): it runs as butterflies within each rank's part, then across ranks")

    @property
    def full(self) -> dict[str, tuple[int, ...]]:
        return {key: spec.full for key, spec in self.specs.items()}

    def check_file(self, state: dict[str, torch.Tensor], path: Path) -> None:
        # the 16-bit tensors: float specs less the float8 ones (read as float32 where no float8 matmul runs)
        floats = {key for key, spec in self.specs.items() if spec.dtype.is_floating_point} - self.fp8_keys
        check_float_dtypes(state, path, floats)
        if self.fmt.kind == "int4":
            check_int4_file(self.specs, state, self.fmt.group, path)
        for key in self.fp8_keys:
            if key in state and state[key].dtype != FP8:
                raise CheckpointError(f"{path}: tensor {key!r} is {state[key].dtype}, float8 in the first file")

    def assemble(self, model: Transformer, state: dict[str, torch.Tensor], rank: int, tp: int, mp: int,
                 group: dist.ProcessGroup | None) -> None:
        """This block's quantized tensors (removed from `state`) into the model; what is left in `state`
        is 16-bit, for the loader's own assignment."""
        if self.fmt.kind == "int4":
            self._assemble_int4(model, state, tp, group)
        elif self.fmt.kind == "fp8":
            self._assemble_fp8(model, state, rank, tp, mp, group)

    def _assemble_int4(self, model: Transformer, state: dict[str, torch.Tensor], tp: int,
                       group: dist.ProcessGroup | None) -> None:
        for key in [k for k in state if k.endswith(".weight") and _module(k)[1] in LINEARS]:
            base, module = _module(key)
            parts = {name.removeprefix(base + "."): state.pop(name) for name in list(state)
                     if name.startswith(base + ".")}
            adaptor = sorted(name for name in parts if name.startswith("adaptor."))
            lora_a, lora_b = (parts[adaptor[0]], parts[adaptor[1]]) if adaptor else (None, None)
            across = GroupAcross(group) if tp > 1 and module in ROW_PARALLEL else None
            weight = Int4Weight(tuple(parts["weight"].shape), self.fmt.group, parts["weight"], parts["scales"],
                                parts.get("zeros"), lora_a, lora_b, self.fmt.lora_scale or 1.0,
                                self.fmt.hadamard and module == "feed_forward.w2", across)
            try:
                check_int4(key, weight)
            except ValueError as exc:
                raise CheckpointError(f"{exc}") from exc
            self._place(model, base, weight, tp, group)
        for table in INT8_TABLES:
            if f"{table}.weight" in state:
                q, scales = state.pop(f"{table}.weight"), state.pop(f"{table}.scales")
                tiled = int8_tiles(q, scales) if table == "output" and self.c_kernels else None
                if tiled is not None:
                    self._place(model, table, tiled, tp, group)
                else:
                    state[f"{table}.weight"] = dequantize_rows(q, scales, self.dtype)

    def _place(self, model: Transformer, base: str, weight: Int4Weight | Fp8Weight, tp: int,
               group: dist.ProcessGroup | None) -> None:
        comm = tp_sharding(base, self.args.family).comm if tp > 1 else NONE
        parent, _, child = base.rpartition(".")
        setattr(model.get_submodule(parent), child, quantized_module(weight, comm, group if tp > 1 else None))

    def _fp8_table(self, m: int) -> dict[str, torch.Tensor]:
        if m not in self._fp8_tables:
            path = self.fmt.fp8_scales[m]
            try:
                table = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise CheckpointError(f"{path}: cannot be read as a PyTorch file, truncated or damaged? "
                                      f"({type(exc).__name__}: {exc})") from exc
            if not isinstance(table, dict):
                raise CheckpointError(f"{path}: expected a dict of scale tensors, got {type(table).__name__}")
            self._fp8_tables[m] = table
        return self._fp8_tables[m]

    def fp8_scales(self, key: str, m: int, rows: int) -> torch.Tensor:
        """File m's row scales of `key` ([rows] float32), checked."""
        path = self.fmt.fp8_scales[m]
        layer, module = key.split(".")[1], _module(key)[1]
        name = f"{layer}_{module}_{m}"
        table = self._fp8_table(m)
        if name not in table:
            raise CheckpointError(f"{path}: no scale {name!r} for the float8 tensor {key!r} of "
                                  f"consolidated.{m:02d}.pth")
        scales = table[name]
        if not isinstance(scales, torch.Tensor) or not scales.is_floating_point() or scales.numel() != rows \
                or scales.dim() > 2:
            shape = tuple(scales.shape) if isinstance(scales, torch.Tensor) else type(scales).__name__
            raise CheckpointError(f"{path}: scale {name!r} has shape {shape}: expected [{rows}] floats, one per row "
                                  f"of {key!r} in consolidated.{m:02d}.pth")
        return scales.reshape(rows).float()

    def _assemble_fp8(self, model: Transformer, state: dict[str, torch.Tensor], rank: int, tp: int, mp: int,
                      group: dist.ProcessGroup | None) -> None:
        for key in [k for k in state if k in self.fp8_keys]:
            spec = self.specs[key]
            data = state.pop(key)
            slices = self._fp8_slices(key, spec, rank, tp, mp)
            if data.dtype != FP8:
                for (c0, c1), scales in slices:
                    data[:, c0:c1] *= scales[:, None]
                state[key] = data.to(self.dtype)
                continue
            weight = Fp8Weight(tuple(data.shape),
                               [data[:, c0:c1].contiguous().to(self.device) for (c0, c1), _ in slices],
                               [s[None, :].contiguous().to(self.device) for _, s in slices])
            self._place(model, _module(key)[0], weight, tp, group)

    def _fp8_slices(self, key: str, spec: TensorSpec, rank: int, tp: int, mp: int
                    ) -> list[tuple[tuple[int, int], torch.Tensor]]:
        """((first, end) columns of this rank's slice, row scales [rows]) for each file the slice draws on."""
        rows, cols = spec.full
        dim = spec.dim if tp > 1 else None
        split = spec.dim if mp > 1 else None  # fairscale split the files as the shard table does
        want = ((rank * rows // tp, (rank + 1) * rows // tp) if dim == 0 else (0, rows),
                (rank * cols // tp, (rank + 1) * cols // tp) if dim == 1 else (0, cols))
        if split == 0:  # files hold row blocks: one slice of columns, its scales from every file it spans
            per = rows // mp
            parts = [self.fp8_scales(key, m, per) for m in range(want[0][0] // per, -(-want[0][1] // per))]
            scales = torch.cat(parts)[want[0][0] - want[0][0] // per * per:][: want[0][1] - want[0][0]]
            return [((0, want[1][1] - want[1][0]), scales)]
        if split is None:
            return [((0, want[1][1] - want[1][0]), self.fp8_scales(key, 0, rows)[want[0][0]: want[0][1]])]
        per = cols // mp  # files hold column blocks (w2): one slice per file, each its own row scales
        out = []
        for m in range(want[1][0] // per, -(-want[1][1] // per)):
            lo, hi = max(want[1][0], m * per), min(want[1][1], (m + 1) * per)
            out.append(((lo - want[1][0], hi - want[1][0]), self.fp8_scales(key, m, rows)[want[0][0]: want[0][1]]))
        return out
