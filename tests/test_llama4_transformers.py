"""Llama 4 decode across chunk boundaries, against transformers' Llama4ForCausalLM.

Meta's model (tests/test_llama4.py's oracle) applies its chunked-attention mask only to a prefill, so
there our decode steps are checked by re-prefilling Meta's model. transformers' port builds the chunk
mask at every step of a cached decode, which makes it an oracle for the decode path itself: its greedy
replies, generated with its KV cache, are compared with our engine's. The HF model is built in float32
from the same random download-layout checkpoint through a key mapping written here, proven first by
HF's prefill logits equalling Meta's, and HF's cached decode is checked against HF's own prefill of
prompt + reply so a decode that dropped the chunk mask would show.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.testing.tokenizer_train import build_tokenizer

from tests.support.meta_llama4 import ffn_widths, is_moe_layer, meta_run, small_params, write_llama4_checkpoint

if TYPE_CHECKING:  # imported where used: transformers takes seconds to import, in each xdist worker's collection
    from transformers import Llama4ForCausalLM, Llama4TextConfig

# 2,304 ids: the least a trained tokenizer has in Llama 4's format (256 byte-level tokens, 2,048 special ids).
PARAMS = small_params(n_kv_heads=4, vocab_size=256 + 2048)
LENGTHS = (9, 40, 75)  # replies of NEW tokens cross the boundary at 32, 64 and 96 during decode
NEW = 30
NEAR_TIE = 1e-3  # a top-2 gap (logits or router scores) below this is one float32 may legitimately flip


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One CPU thread: the model is tiny, and the C kernels' threads wait on each other whenever another
    process holds a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MP-1 checkpoint with Meta's non-parameter entries, and a tokenizer for our engine."""
    path = tmp_path_factory.mktemp("llama4_hf")
    write_llama4_checkpoint(path, PARAMS, 1, seed=3, extra_entries=True)
    build_tokenizer("llama3", path / "tokenizer.model", 512)  # 256 base tokens, read in Llama 4's format
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, PARAMS["vocab_size"], (n,), generator=gen).tolist() for n in LENGTHS]


def hf_config() -> Llama4TextConfig:
    """params.json restated in HF's terms; the layer kinds are given explicitly by Meta's rules."""
    from transformers import Llama4TextConfig

    dense_f, moe_f = ffn_widths(PARAMS)
    layers = range(PARAMS["n_layers"])
    return Llama4TextConfig(
        vocab_size=PARAMS["vocab_size"], hidden_size=PARAMS["dim"], intermediate_size=moe_f,
        intermediate_size_mlp=dense_f, num_hidden_layers=PARAMS["n_layers"],
        num_attention_heads=PARAMS["n_heads"], num_key_value_heads=PARAMS["n_kv_heads"],
        head_dim=PARAMS["dim"] // PARAMS["n_heads"], rms_norm_eps=PARAMS["norm_eps"],
        num_local_experts=PARAMS["moe_args"]["num_experts"], num_experts_per_tok=PARAMS["moe_args"]["top_k"],
        moe_layers=[n for n in layers if is_moe_layer(PARAMS, n)],
        no_rope_layers=[int((n + 1) % PARAMS["nope_layer_interval"] != 0) for n in layers],  # 1: RoPE
        attention_chunk_size=PARAMS["attention_chunk_size"], use_qk_norm=PARAMS["use_qk_norm"],
        attn_temperature_tuning=PARAMS["attn_temperature_tuning"], attn_scale=PARAMS["attn_scale"],
        floor_scale=int(PARAMS["floor_scale"]),  # HF types it int; Meta's params.json writes 8.0
        rope_parameters={"rope_type": "default", "rope_theta": PARAMS["rope_theta"]},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
        attn_implementation="eager",
    )


def hf_state_dict(download: dict[str, object]) -> dict[str, torch.Tensor]:
    """The download's keys in HF's names and shapes, in float32; Meta's non-parameter entries dropped.

    HF's rotary embedding rotates interleaved (real, imaginary) pairs as Meta's does, so q and k keep
    their row order; HF's experts take x @ w like Meta's, with gate and up concatenated on the output dim.
    """
    dim, heads, kv = PARAMS["dim"], PARAMS["n_heads"], PARAMS["n_kv_heads"]
    hd, experts = dim // heads, PARAMS["moe_args"]["num_experts"]
    src = {k: v.float() for k, v in download.items() if isinstance(v, torch.Tensor)}
    out = {"model.embed_tokens.weight": src["tok_embeddings.weight"], "model.norm.weight": src["norm.weight"],
           "lm_head.weight": src["output.weight"]}
    for n in range(PARAMS["n_layers"]):
        p, h = f"layers.{n}.", f"model.layers.{n}."
        q, k, v = src[p + "attention.wqkv.weight"].split([heads * hd, kv * hd, kv * hd])
        out |= {h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k,
                h + "self_attn.v_proj.weight": v, h + "self_attn.o_proj.weight": src[p + "attention.wo.weight"],
                h + "input_layernorm.weight": src[p + "attention.wqkv.layer_norm_weight"]}
        f = h + "feed_forward."
        if not is_moe_layer(PARAMS, n):
            gate, up = src[p + "feed_forward.mlp.fc1_weight"].chunk(2)  # w1 rows, then w3 rows
            out |= {f + "gate_proj.weight": gate, f + "up_proj.weight": up,
                    f + "down_proj.weight": src[p + "feed_forward.mlp.fc2_weight"],
                    h + "post_attention_layernorm.weight": src[p + "feed_forward.mlp.layer_norm_weight"]}
            continue
        e = p + "feed_forward.experts."
        gate = src[e + "moe_w_in_eD_F"].view(experts, dim, -1)
        up = src[e + "moe_w_swiglu_eD_F"].view(experts, dim, -1)
        out |= {f + "router.weight": src[p + "feed_forward.router_DE"].T,
                f + "experts.gate_up_proj": torch.cat([gate, up], dim=2),
                f + "experts.down_proj": src[e + "moe_w_out_eF_D"].view(experts, -1, dim),
                f + "shared_expert.gate_proj.weight": src[p + "feed_forward.w_in_shared_FD.weight"],
                f + "shared_expert.up_proj.weight": src[p + "feed_forward.w_swiglu_FD.weight"],
                f + "shared_expert.down_proj.weight": src[p + "feed_forward.w_out_shared_DF.weight"],
                h + "post_attention_layernorm.weight": src[p + "feed_forward.norm.weight"]}
    return {k: v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def hf_model(folder: Path) -> Llama4ForCausalLM:
    """HF's model on the checkpoint, loaded strictly, with its layer kinds checked against params.json."""
    from transformers import Llama4ForCausalLM

    with torch.serialization.safe_globals([io.BytesIO]):  # the `_extra_state` entries
        download = torch.load(folder / "consolidated.00.pth", map_location="cpu", weights_only=True)
    model = Llama4ForCausalLM(hf_config()).float().eval()
    model.load_state_dict(hf_state_dict(download), strict=True)
    nope = [(n + 1) % PARAMS["nope_layer_interval"] == 0 for n in range(PARAMS["n_layers"])]
    assert [layer.is_moe_layer for layer in model.model.layers] == [
        is_moe_layer(PARAMS, n) for n in range(PARAMS["n_layers"])] == [False, True, False, True]
    assert [not layer.self_attn.use_rope for layer in model.model.layers] == nope == [False, False, False, True]
    assert [hasattr(layer.self_attn, "qk_norm") for layer in model.model.layers] == [not x for x in nope]
    assert model.config.layer_types == ["full_attention" if x else "chunked_attention" for x in nope]
    return model


def hf_reply(model: Llama4ForCausalLM, prompt: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """HF's greedy reply with its KV cache, the logits of each step [NEW, V], and per fed token the
    smallest top-2 gap of the MoE routers' scores [len(prompt) + NEW - 1] (a router near-tie there may
    route a token differently in another float32 implementation)."""
    calls: list[torch.Tensor] = []

    def record(_module: torch.nn.Module, _args: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        top2 = output[1].topk(2, dim=-1).values
        calls.append(top2[:, 0] - top2[:, 1])

    hooks = [layer.feed_forward.router.register_forward_hook(record)
             for layer in model.model.layers if layer.is_moe_layer]
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                                 return_dict_in_generate=True, output_logits=True)
    finally:
        for hook in hooks:
            hook.remove()
    moe = len(hooks)
    per_step = [torch.stack(calls[i:i + moe]).amin(0) for i in range(0, len(calls), moe)]  # MoE layers, per call
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits), torch.cat(per_step)


def test_hf_prefill_matches_meta(folder, prompts, hf_model):
    """The mapping is right: HF's logits for a 40-token prefill (two chunks, NoPE temperature past 7) are Meta's."""
    prompt = prompts[1]
    meta = meta_run(folder, [prompt], mp=1)["logits"][0]
    with torch.inference_mode():
        hf = hf_model(torch.tensor([prompt])).logits[0]
    assert meta.std() > 1.0 and meta.argmax(-1).unique().numel() > 20  # informative enough to tell a wrong weight
    worst = (hf - meta).abs().max().item()
    assert worst < 1e-4 * meta.abs().max().item(), f"HF and Meta prefill logits differ by {worst}"


def test_decode_across_chunks_matches_transformers(folder, prompts, hf_model):
    """Our greedy replies equal HF's cached greedy decode up to the first near-tie, and HF's decode
    steps give HF's own prefill logits (its cache path applies the chunk mask, as its prefill does)."""
    engine = Engine.load(EngineConfig(str(folder), "tp", "float32", max_seq_len=128, max_batch_size=4,
                                      prefill_budget=48))
    scheduler = engine.new_scheduler()
    scheduler.stop_ids = frozenset()  # random weights: every reply runs its NEW tokens
    seqs = [Sequence(str(i), p, SamplingParams(NEW)) for i, p in enumerate(prompts)]
    for seq in seqs:
        scheduler.add(seq)
    engine.run(scheduler)
    for prompt, seq in zip(prompts, seqs):
        theirs, steps, router_gaps = hf_reply(hf_model, prompt)
        assert len(seq.output) == len(theirs) == NEW
        with torch.inference_mode():
            prefilled = hf_model(torch.tensor([prompt + theirs[:-1]])).logits[0, len(prompt) - 1:]
        worst = (steps - prefilled).abs().max().item()
        assert worst < 1e-4 * prefilled.abs().max().item(), f"{len(prompt)}-token prompt: HF decode vs prefill {worst}"
        first = next((i for i, (a, b) in enumerate(zip(seq.output, theirs)) if a != b), None)
        if first is None:
            continue
        top2 = steps[first].topk(2).values
        gap, router_gap = (top2[0] - top2[1]).item(), router_gaps[:len(prompt) + first].min().item()
        assert gap < NEAR_TIE or router_gap < NEAR_TIE, (
            f"{len(prompt)}-token prompt, reply token {first}: ours {seq.output[first]}, HF {theirs[first]}, "
            f"HF's top-2 logit gap {gap:.2e}, least router top-2 gap {router_gap:.2e}")
