"""An independent, single-process Llama forward in float64, for parity tests.

Written from the model's math (Meta's reference semantics), sharing no code with ``tp_llama``'s
model, params, layout or loader: it reads params.json and the consolidated files itself,
glues the shards back into full tensors, and recomputes the whole sequence at every greedy
step (no KV cache), so it has none of the engine's moving parts to get wrong in the same way.
Only the tokenizer is borrowed (for vocab_size -1 and for stop ids), since it is not part of
the forward.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

DTYPE = torch.float64

# Llama 3.1 rope scaling constants (Meta's apply_scaling).
ROPE_SCALE_FACTOR = 8.0
ROPE_LOW_FREQ_FACTOR = 1.0
ROPE_HIGH_FREQ_FACTOR = 4.0
ROPE_ORIGINAL_CONTEXT = 8192.0

_FILE_NAME = re.compile(r"consolidated\.(\d+)\.pth")


@dataclass(frozen=True)
class Config:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    use_scaled_rope: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def read_config(ckpt_dir: str | Path, tokenizer_size: int) -> Config:
    """params.json (flat or nested under "model"), with Meta's implicit defaults filled in."""
    raw = json.loads((Path(ckpt_dir) / "params.json").read_text())
    if isinstance(raw.get("model"), dict):
        raw = raw["model"]
    dim = raw["dim"]
    n_heads = raw["n_heads"]
    n_kv_heads = raw.get("n_kv_heads") or n_heads
    hidden = int(2 * 4 * dim / 3)
    if raw.get("ffn_dim_multiplier"):
        hidden = int(raw["ffn_dim_multiplier"] * hidden)
    multiple_of = raw.get("multiple_of", 256)
    hidden = multiple_of * math.ceil(hidden / multiple_of)
    vocab = raw.get("vocab_size", -1)
    if vocab <= 0:
        vocab = tokenizer_size
    return Config(
        dim=dim,
        n_layers=raw["n_layers"],
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=vocab,
        ffn_dim=hidden,
        norm_eps=float(raw["norm_eps"]),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        use_scaled_rope=bool(raw.get("use_scaled_rope", False)),
    )


def expected_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Full (unsplit) shape of every parameter, written out from the architecture."""
    d, hd, f, v = cfg.dim, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (v, d), "norm.weight": (d,), "output.weight": (v, d)}
    for i in range(cfg.n_layers):
        shapes.update(
            {
                f"layers.{i}.attention.wq.weight": (cfg.n_heads * hd, d),
                f"layers.{i}.attention.wk.weight": (cfg.n_kv_heads * hd, d),
                f"layers.{i}.attention.wv.weight": (cfg.n_kv_heads * hd, d),
                f"layers.{i}.attention.wo.weight": (d, cfg.n_heads * hd),
                f"layers.{i}.feed_forward.w1.weight": (f, d),
                f"layers.{i}.feed_forward.w2.weight": (d, f),
                f"layers.{i}.feed_forward.w3.weight": (f, d),
                f"layers.{i}.attention_norm.weight": (d,),
                f"layers.{i}.ffn_norm.weight": (d,),
            }
        )
    return shapes


def split_dim(key: str, family: str) -> int | None:
    """The dim fairscale split a tensor along (None: whole in every file), by Meta's names and
    family, written out here independently of tp_llama.layout."""
    if key == "tok_embeddings.weight":
        return 1 if family == "llama2" else 0
    if key.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight")) or key == "output.weight":
        return 0
    if key.endswith(("wo.weight", "w2.weight")):
        return 1
    return None


def consolidated_files(ckpt_dir: str | Path) -> list[Path]:
    found = {}
    for path in Path(ckpt_dir).iterdir():
        match = _FILE_NAME.fullmatch(path.name)
        if match:
            found[int(match.group(1))] = path
    if sorted(found) != list(range(len(found))) or not found:
        raise ValueError(f"{ckpt_dir}: consolidated files are not numbered 00..N-1: {sorted(found)}")
    return [found[i] for i in range(len(found))]


def reassemble(ckpt_dir: str | Path, cfg: Config) -> dict[str, torch.Tensor]:
    """Full float64 tensors from the MP files: concatenate where a shard is smaller than the full shape.

    The split dim is read from shapes alone; tensors every file holds whole must be identical copies.
    """
    pieces = [torch.load(p, map_location="cpu", weights_only=True) for p in consolidated_files(ckpt_dir)]
    for state in pieces:
        state.pop("rope.freqs", None)
    shapes = expected_shapes(cfg)
    for path_index, state in enumerate(pieces):
        if set(state) != set(shapes):
            missing, extra = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
            raise ValueError(f"file {path_index}: missing {missing[:3]}, unexpected {extra[:3]}")
    full: dict[str, torch.Tensor] = {}
    for key, shape in shapes.items():
        parts = [state[key] for state in pieces]
        part_shape = tuple(parts[0].shape)
        if any(tuple(p.shape) != part_shape for p in parts):
            raise ValueError(f"{key}: files hold pieces of different shapes")
        differing = [d for d in range(len(shape)) if part_shape[d] != shape[d]]
        if not differing:
            for p in parts[1:]:
                if not torch.equal(p, parts[0]):
                    raise ValueError(f"{key}: replicated tensor differs between files")
            tensor = parts[0]
        elif len(differing) == 1 and part_shape[differing[0]] * len(parts) == shape[differing[0]]:
            tensor = torch.cat(parts, dim=differing[0])
        else:
            raise ValueError(f"{key}: piece shape {part_shape} is no split of {shape} over {len(parts)} files")
        full[key] = tensor.to(DTYPE)
    return full


def rotation_speeds(cfg: Config) -> torch.Tensor:
    """theta^(-2i/hd) for each adjacent pair i, with Llama 3.1's long-context rescaling if asked."""
    hd = cfg.head_dim
    speeds = [cfg.rope_theta ** (-(2 * i) / hd) for i in range(hd // 2)]
    if cfg.use_scaled_rope:
        short_wave = ROPE_ORIGINAL_CONTEXT / ROPE_HIGH_FREQ_FACTOR
        long_wave = ROPE_ORIGINAL_CONTEXT / ROPE_LOW_FREQ_FACTOR
        scaled = []
        for speed in speeds:
            wavelength = 2 * math.pi / speed
            if wavelength < short_wave:
                scaled.append(speed)
            elif wavelength > long_wave:
                scaled.append(speed / ROPE_SCALE_FACTOR)
            else:
                mix = (ROPE_ORIGINAL_CONTEXT / wavelength - ROPE_LOW_FREQ_FACTOR) / (
                    ROPE_HIGH_FREQ_FACTOR - ROPE_LOW_FREQ_FACTOR
                )
                scaled.append((1 - mix) * speed / ROPE_SCALE_FACTOR + mix * speed)
        speeds = scaled
    return torch.tensor(speeds, dtype=DTYPE)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
    """x [S, heads, hd]: element pairs (2i, 2i+1) as complex numbers, times e^{i*angle}."""
    as_complex = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(as_complex * phases[:, None, :]).reshape(x.shape)


@dataclass
class ReferenceModel:
    cfg: Config
    weights: dict[str, torch.Tensor]
    # What each matmul's input becomes first (the C kernels' int8 rows, for quantized weights).
    matmul_input: Callable[[torch.Tensor], torch.Tensor] | None = None
    speeds: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.speeds = rotation_speeds(self.cfg)

    @classmethod
    def load(cls, ckpt_dir: str | Path, tokenizer_size: int) -> ReferenceModel:
        cfg = read_config(ckpt_dir, tokenizer_size)
        return cls(cfg, reassemble(ckpt_dir, cfg))

    def mm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ W^T for the weight of that name, x first as matmul_input makes it."""
        return (x if self.matmul_input is None else self.matmul_input(x)) @ self.weights[name].T

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits [S, V] for one whole sequence starting at position 0."""
        cfg, w, mm = self.cfg, self.weights, self.mm
        seq = len(tokens)
        hd, n_rep = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
        angles = torch.outer(torch.arange(seq, dtype=DTYPE), self.speeds)
        phases = torch.polar(torch.ones_like(angles), angles)
        future = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
        h = w["tok_embeddings.weight"][torch.tensor(tokens)]
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            x = rms_norm(h, w[p + "attention_norm.weight"], cfg.norm_eps)
            q = mm(x, p + "attention.wq.weight").reshape(seq, cfg.n_heads, hd)
            k = mm(x, p + "attention.wk.weight").reshape(seq, cfg.n_kv_heads, hd)
            v = mm(x, p + "attention.wv.weight").reshape(seq, cfg.n_kv_heads, hd)
            q, k = rotate(q, phases), rotate(k, phases)
            # Query head j reads KV head j // n_rep (Meta's repeat_kv).
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
            scores = scores.masked_fill(future, float("-inf"))
            attn = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).reshape(seq, cfg.n_heads * hd)
            h = h + mm(attn, p + "attention.wo.weight")
            x = rms_norm(h, w[p + "ffn_norm.weight"], cfg.norm_eps)
            gate = mm(x, p + "feed_forward.w1.weight")
            up = mm(x, p + "feed_forward.w3.weight")
            h = h + mm(gate * torch.sigmoid(gate) * up, p + "feed_forward.w2.weight")
        return mm(rms_norm(h, w["norm.weight"], cfg.norm_eps), "output.weight")


@dataclass(frozen=True)
class ReferenceResult:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    # Gap between the best and second-best logit at each greedy pick (one entry per pick).
    top2_gaps: list[float]


def greedy(
    model: ReferenceModel, prompt_ids: list[int], max_new_tokens: int, stop_ids: frozenset[int], ignore_eos: bool = False
) -> ReferenceResult:
    """Greedy decoding by recomputing the whole sequence each step; a stop token ends it unreturned."""
    sequence = list(prompt_ids)
    out: list[int] = []
    gaps: list[float] = []
    while len(out) < max_new_tokens:
        last = model.logits(sequence)[-1]
        top = torch.topk(last, 2)
        gaps.append(float(top.values[0] - top.values[1]))
        token = int(top.indices[0])
        if token in stop_ids and not ignore_eos:
            return ReferenceResult(out, "stop", gaps)
        out.append(token)
        sequence.append(token)
    return ReferenceResult(out, "length", gaps)
