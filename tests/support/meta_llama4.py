"""Meta's own Llama 4 text model as a test oracle: random checkpoints in Meta's download layout, and
llama-models 0.3.0's `llama4.model.Transformer` run on them over fairscale model parallel (gloo, CPU).

The download's key names are those of Meta's training code (TransformerEngine's fused modules), not the
module's state_dict names; llama-models translates them in `_register_load_state_dict_pre_hook` hooks,
so the writer here emits the inverse of those hooks and the oracle loads strictly through them, which
makes every written key one that Meta's own loader consumes. Meta's `Llama4.build`/`generate` are
wired to NCCL and CUDA, so the oracle builds the `Transformer` itself in spawned gloo ranks
(tests.support.dist_util.run_ranks), with the KV cache's `.cuda()` made a no-op while it is built.

Per-shard layout written (MP ranks r of `mp`; F is a layer's FFN width; every MoE shard holds all E
experts with their F split, as Meta's files do):

    tok_embeddings.weight                        [V/mp, D]      vocabulary split (VocabParallelEmbedding)
    norm.weight                                  [D]            replicated
    output.weight                                [V/mp, D]
    layers.N.attention.wqkv.weight               [(H+2K)*hd/mp, D]  this shard's q rows, k rows, v rows
    layers.N.attention.wo.weight                 [D, H*hd/mp]
    layers.N.attention.wqkv.layer_norm_weight    [D]            attention norm, replicated
  dense layers:
    layers.N.feed_forward.mlp.fc1_weight         [2F/mp, D]     this shard's w1 rows then w3 rows
    layers.N.feed_forward.mlp.fc2_weight         [D, F/mp]
    layers.N.feed_forward.mlp.layer_norm_weight  [D]            ffn norm, replicated
  MoE layers:
    layers.N.feed_forward.norm.weight            [D]            ffn norm, replicated
    layers.N.feed_forward.router_DE              [D, E]         replicated
    layers.N.feed_forward.w_in_shared_FD.weight  [F/mp, D]      shared expert w1
    layers.N.feed_forward.w_swiglu_FD.weight     [F/mp, D]      shared expert w3
    layers.N.feed_forward.w_out_shared_DF.weight [D, F/mp]      shared expert w2
    layers.N.feed_forward.experts.moe_w_in_eD_F     [E*D, F/mp]  expert w1, x @ w (in, out)
    layers.N.feed_forward.experts.moe_w_swiglu_eD_F [E*D, F/mp]  expert w3
    layers.N.feed_forward.experts.moe_w_out_eF_D    [E*F/mp, D]  expert w2

`extra_entries=True` adds what the real files carry and a loader drops (EXTRA_SUFFIXES): `rope.freqs`,
per layer `attention.wqkv._extra_state` and `attention.wo._extra_state`, per MoE layer
`feed_forward.experts.mlp._extra_state`, `feed_forward.mlp_shared._extra_state` (pickled io.BytesIO
values, which the hooks drop), `feed_forward.global_gate_stats_3E` [3, E] and
`feed_forward.expert_activation_DE` [D, E] (tensors no hook consumes: Meta loads with strict=False).
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from unittest import mock

import torch

from tests.support.dist_util import run_ranks

META_VOCAB = 202048  # Llama 4's vocabulary: a checkpoint this large gets Meta's tokenizer.model
STATE_SUFFIXES = ("attention.wqkv._extra_state", "attention.wo._extra_state")
MOE_STATE_SUFFIXES = ("feed_forward.experts.mlp._extra_state", "feed_forward.mlp_shared._extra_state")
MOE_STAT_SUFFIXES = ("feed_forward.global_gate_stats_3E", "feed_forward.expert_activation_DE")
EXTRA_SUFFIXES = ("rope.freqs",) + STATE_SUFFIXES + MOE_STATE_SUFFIXES + MOE_STAT_SUFFIXES


def small_params(**overrides: object) -> dict:
    """A small Llama 4 text params.json: every iRoPE/MoE feature on, at sizes a CPU runs in a second.

    Layers 0..3: layer 3 is NoPE (nope_layer_interval 4: global attention, no RoPE, no QK norm,
    temperature tuning), the others RoPE layers on 32-token chunks; interleave step 2 makes layers 1
    and 3 MoE (dense FFN 448, MoE/shared FFN 224). floor_scale 8 makes the NoPE layer's query
    scale 1 + 0.1*log(floor((pos+1)/8)+1) differ from 1 from position 7 on. Heads 8 and KV heads 2
    divide by MP 1 and 2; `moe_args` given as an override replaces the whole dict.
    """
    params = {
        "dim": 128, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2, "vocab_size": 256,
        "multiple_of": 32, "ffn_dim_multiplier": 1.3, "ffn_exp": 4.0, "norm_eps": 1e-5,
        "rope_theta": 500000.0, "use_scaled_rope": False,
        "moe_args": {"num_experts": 4, "top_k": 1, "interleave_moe_layer_step": 2,
                     "capacity_factor": 1.0, "auto_scale_F": True},
        "nope_layer_interval": 4, "use_qk_norm": True, "attention_chunk_size": 32,
        "attn_temperature_tuning": True, "floor_scale": 8.0, "attn_scale": 0.1,
    }
    params.update(overrides)
    return params


def random_served(params: dict, dtype: torch.dtype, slots: int, max_seq_len: int) -> torch.nn.Module:
    """Our model of `params` with random weights (seed 0), prepared for serving (the C kernels where they run),
    with a paged cache of `slots` slots (tests/support/run_model.py)."""
    from tp_llama import backend
    from tp_llama.checkpoint.params import parse_params
    from tp_llama.model import build
    from tests.support.run_model import setup_slots

    torch.manual_seed(0)
    model = build(parse_params(params, Path("params.json"))).to(dtype)
    for name, weight in model.named_parameters():
        if "experts" in name or "router" in name:  # left uninitialised by the model
            torch.nn.init.normal_(weight, std=weight.shape[0] ** -0.5)
    backend.optimize(model)
    setup_slots(model, slots, max_seq_len, dtype, torch.device("cpu"))
    return model


def is_moe_layer(params: dict, layer: int) -> bool:
    """Whether `layer` has a MoE feed-forward (TransformerBlock's rule: every step-th layer, 1-based)."""
    moe = params.get("moe_args")
    return bool(moe) and (layer + 1) % moe.get("interleave_moe_layer_step", 1) == 0


def ffn_widths(params: dict) -> tuple[int, int]:
    """(dense FFN width, MoE expert/shared width), restating TransformerBlock's and MoE's arithmetic."""
    dim, multiple = params["dim"], params["multiple_of"]
    mult = params.get("ffn_dim_multiplier")
    dense = int(2 * int(4 * dim) / 3)
    if mult is not None:
        dense = int(mult * dense)
    dense = multiple * ((dense + multiple - 1) // multiple)
    moe_f = 0
    if params.get("moe_args"):
        moe = params["moe_args"]
        moe_f = int(mult * int(2 * int(params["ffn_exp"] * dim) / 3))
        if moe.get("auto_scale_F", True):
            moe_f = int(moe_f / (moe.get("capacity_factor", 1.0) + 1))
        moe_f += -moe_f % multiple
    return dense, moe_f


def _full_layout(params: dict, gen: torch.Generator) -> dict[str, list[tuple[torch.Tensor, int | None]]]:
    """Every download key's MP-1 tensor(s), each with the dim fairscale splits it on (None: replicated).

    A key with several parts (wqkv: q, k, v; fc1: w1, w3) is split part by part and the shards'
    parts concatenated on dim 0; a 3-D part (experts [E, in, out]) is flattened to 2-D after its split.
    Matrices are N(0, 1/fan_in) so activations keep their scale through the layers; norms 1 +- 0.2.
    """
    dim, heads, kv, vocab = params["dim"], params["n_heads"], params["n_kv_heads"], params["vocab_size"]
    hd = dim // heads
    dense_f, moe_f = ffn_widths(params)

    def mat(rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * (scale / cols ** 0.5)

    def norm() -> torch.Tensor:
        return 1.0 + 0.2 * (torch.rand(dim, generator=gen) * 2 - 1)

    out: dict[str, list[tuple[torch.Tensor, int | None]]] = {
        "tok_embeddings.weight": [(torch.randn(vocab, dim, generator=gen), 0)],
    }
    for n in range(params["n_layers"]):
        p = f"layers.{n}."
        out[p + "attention.wqkv.weight"] = [(mat(heads * hd, dim), 0), (mat(kv * hd, dim), 0), (mat(kv * hd, dim), 0)]
        out[p + "attention.wo.weight"] = [(mat(dim, heads * hd), 1)]
        out[p + "attention.wqkv.layer_norm_weight"] = [(norm(), None)]
        if not is_moe_layer(params, n):
            out[p + "feed_forward.mlp.fc1_weight"] = [(mat(dense_f, dim), 0), (mat(dense_f, dim), 0)]
            out[p + "feed_forward.mlp.fc2_weight"] = [(mat(dim, dense_f), 1)]
            out[p + "feed_forward.mlp.layer_norm_weight"] = [(norm(), None)]
            continue
        experts = params["moe_args"]["num_experts"]
        out[p + "feed_forward.norm.weight"] = [(norm(), None)]
        # Scores x_aD @ router_DE have std ~2 on a normed x, so the top-1 expert wins clearly.
        out[p + "feed_forward.router_DE"] = [(mat(dim, experts, 2.0 * (experts / dim) ** 0.5), None)]
        out[p + "feed_forward.w_in_shared_FD.weight"] = [(mat(moe_f, dim), 0)]
        out[p + "feed_forward.w_swiglu_FD.weight"] = [(mat(moe_f, dim), 0)]
        out[p + "feed_forward.w_out_shared_DF.weight"] = [(mat(dim, moe_f), 1)]
        gate = torch.randn(experts, dim, moe_f, generator=gen) / dim ** 0.5
        up = torch.randn(experts, dim, moe_f, generator=gen) / dim ** 0.5
        down = torch.randn(experts, moe_f, dim, generator=gen) / moe_f ** 0.5
        out[p + "feed_forward.experts.moe_w_in_eD_F"] = [(gate, 2)]
        out[p + "feed_forward.experts.moe_w_swiglu_eD_F"] = [(up, 2)]
        out[p + "feed_forward.experts.moe_w_out_eF_D"] = [(down, 1)]
    out["norm.weight"] = [(norm(), None)]
    out["output.weight"] = [(mat(vocab, dim, 3.0), 0)]
    return out


def _extras(params: dict, gen: torch.Generator) -> dict[str, object]:
    """The entries a loader drops, the same in every shard; BytesIO values as TransformerEngine pickles them."""
    hd = params["dim"] // params["n_heads"]
    theta = params.get("rope_theta", 500000.0)
    out: dict[str, object] = {"rope.freqs": 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)}
    for n in range(params["n_layers"]):
        suffixes = STATE_SUFFIXES + (MOE_STATE_SUFFIXES if is_moe_layer(params, n) else ())
        for suffix in suffixes:
            out[f"layers.{n}.{suffix}"] = io.BytesIO(b"\x80\x04N.")  # non-empty: an empty one pickles as bytes(), which weights_only refuses
        if is_moe_layer(params, n):
            experts = params["moe_args"]["num_experts"]
            out[f"layers.{n}.feed_forward.global_gate_stats_3E"] = torch.rand(3, experts, generator=gen)
            out[f"layers.{n}.feed_forward.expert_activation_DE"] = torch.zeros(params["dim"], experts)
    return out


def _check_divisible(params: dict, mp: int) -> None:
    """Fail with the reason up front, as fairscale would only fail on a shape mismatch later."""
    dense_f, moe_f = ffn_widths(params)
    sizes = {"n_heads": params["n_heads"], "n_kv_heads": params["n_kv_heads"], "vocab_size": params["vocab_size"],
             "dense FFN": dense_f, "MoE FFN": moe_f}
    bad = {name: size for name, size in sizes.items() if size % mp}
    if bad:
        raise ValueError(f"MP {mp} does not divide {bad}")


def write_llama4_checkpoint(folder: Path | str, params: dict, mp: int, seed: int = 0,
                            dtype: torch.dtype = torch.bfloat16, tokenizer: Path | None = None,
                            extra_entries: bool = False) -> None:
    """Write params.json and consolidated.00.pth .. consolidated.{mp-1}.pth of a random Llama 4 text model.

    The same (params, seed) gives the same model whatever `mp`, since the MP-1 tensors are drawn
    first and then sliced per shard. `tokenizer`: a tokenizer.model to copy; None copies Meta's
    Llama 4 one when the vocabulary is Meta's size and writes none for a small vocabulary.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _check_divisible(params, mp)
    gen = torch.Generator().manual_seed(seed)
    layout = _full_layout(params, gen)
    extras = _extras(params, gen) if extra_entries else {}
    for rank in range(mp):
        shard: dict[str, object] = {}
        for key, parts in layout.items():
            pieces = [t if d is None else t.chunk(mp, dim=d)[rank] for t, d in parts]
            value = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
            shard[key] = (value.flatten(0, 1) if value.dim() == 3 else value).to(dtype).contiguous()
        shard.update(extras)
        torch.save(shard, folder / f"consolidated.{rank:02d}.pth")
    (folder / "params.json").write_text(json.dumps(params, indent=2))
    if tokenizer is None and params["vocab_size"] >= META_VOCAB:
        import llama_models.llama4

        tokenizer = Path(llama_models.llama4.__file__).parent / "tokenizer.model"
    if tokenizer is not None:
        shutil.copyfile(tokenizer, folder / "tokenizer.model")


def _load_file(path: str | Path, _load=torch.load, **kwargs: object) -> dict:
    """torch.load under weights_only, with io.BytesIO allowed for the `_extra_state` entries.

    `_load` is bound at import so a patched torch.load can call the real one.
    """
    kwargs.setdefault("map_location", "cpu")
    kwargs["weights_only"] = True
    with torch.serialization.safe_globals([io.BytesIO]):
        return _load(path, **kwargs)


def _rank_state_dict(folder: Path, args: object) -> dict:
    """This rank's state dict in download names: its own file, or Meta's resharding of all the files.

    Meta's reshard_mp matches `attention.wo._extra_state` with its row-split regex and cannot
    concatenate or chunk a BytesIO, so on that path the files' non-tensor entries are dropped as read.
    """
    from fairscale.nn.model_parallel.initialize import get_model_parallel_rank, get_model_parallel_world_size
    from llama_models.checkpoint import maybe_reshard_state_dict

    files = sorted(folder.glob("consolidated.*.pth"))
    if len(files) == get_model_parallel_world_size():
        return _load_file(files[get_model_parallel_rank()])

    def tensors_only(path: str, **kwargs: object) -> dict:
        return {k: v for k, v in _load_file(path, **kwargs).items() if isinstance(v, torch.Tensor)}

    experts = args.moe_args.num_experts if args.moe_args else None
    try:
        with mock.patch.object(torch, "load", tensors_only):
            return maybe_reshard_state_dict(files, args.n_kv_heads, moe_num_experts=experts)
    finally:
        torch.set_default_dtype(torch.float32)  # maybe_reshard_state_dict set the default type to bfloat16


def _rank_logits(folder: str, prompts: list[list[int]], mp: int) -> dict | None:
    """One gloo rank: build Meta's Transformer in float32, load strictly through its hooks, prefill each prompt."""
    from fairscale.nn.model_parallel.initialize import get_model_parallel_rank, initialize_model_parallel
    from llama_models.llama4.args import ModelArgs
    from llama_models.llama4.datatypes import TransformerInput
    from llama_models.llama4.model import Transformer

    initialize_model_parallel(mp)
    path = Path(folder)
    params = json.loads((path / "params.json").read_text())
    args = ModelArgs(**params, max_seq_len=max(len(p) for p in prompts), max_batch_size=1)
    state = _rank_state_dict(path, args)
    torch.set_default_dtype(torch.float32)
    # Meta's loader uses strict=False; these are the entries no hook consumes, dropped so strict=True holds.
    dropped = sorted(k for k in state if k.endswith(MOE_STAT_SUFFIXES))
    state = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in state.items() if k not in dropped}
    with mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self):  # Attention's KV cache
        model = Transformer(args)
    model.load_state_dict(state, strict=True)
    model.eval()
    logits = [model(TransformerInput(tokens=torch.tensor([p]), tokens_position=0)).logits[0].float().numpy()
              for p in prompts]
    if get_model_parallel_rank() != 0:
        return None  # every rank gathers the full logits; rank 0's suffice
    return {"logits": logits, "dropped": dropped}


def meta_run(folder: Path | str, prompts: list[list[int]], mp: int, timeout_s: float = 120) -> dict:
    """Meta's logits for several prompts in one set of `mp` ranks (spawning costs more than a prefill).

    Returns {"logits": [float32 tensor [len(prompt), vocab] per prompt], "dropped": [keys removed
    before the strict load because no hook consumes them]}.
    """
    result = run_ranks(_rank_logits, mp, str(folder), [list(map(int, p)) for p in prompts], mp,
                       timeout=timeout_s)[0]
    return {"logits": [torch.from_numpy(a) for a in result["logits"]], "dropped": result["dropped"]}


def meta_logits(folder: Path | str, tokens: list[int], mp: int, timeout_s: float = 120) -> torch.Tensor:
    """Float32 logits [len(tokens), vocab] of Meta's Transformer prefilling `tokens` from position 0 at MP `mp`."""
    return meta_run(folder, [tokens], mp, timeout_s)["logits"][0]
