"""Generation benchmark: prefill and decode tokens/s of our engine (TP 1, TP 2) and of transformers.

    python -m bench.engine.generate [--preset quarter] [--batches 1 8] [--prompt-len 128] [--new-tokens 128]
                                    [--rounds 3] [--repeats 1] [--engines ...] [--before COMMIT_OR_PATH]

float32 (or --dtype bfloat16) on CPU, greedy ("ours TP1 sampled": the yaml's default temperature
0.6 and top_p 0.9, a seed per row), stop tokens ignored, the same random prompts for every engine. Both
engines are timed the same way, from the moments new tokens reach the caller: prefill ends
when the first new token of the batch is out, decode covers the remaining new tokens. The
bandwidth floor of a decode step is the bytes it must read over the memory bandwidth measured in
the same run (the best of a copy and a read-only stream, measured before every launch, so a
slow spell of the machine cannot lower the floor): every weight except the embedding table, plus
(second floor) the KV cache of every row at the decode's mean context length. "ours oneDNN" is this checkout with
TP_LLAMA_MATMUL=onednn: oneDNN's matmuls and PyTorch's eager layer ops, the engine as it was
before tp_llama's C kernels. "before TP1" (with --before) is an older checkout (a folder, or a
commit checked out under bench/out/) running its own engine the same way, in the same turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import REPO, before_root, last_json, module_in, stream_bandwidth_gbs, table, torchrun, write_json
from bench.lib.generation import agreement, pooled, prompts
from bench.lib.hf_convert import hf_config, meta_to_hf
from tp_llama.checkpoint.shards import find_shards, load_shard
from tp_llama.config import EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.parallel.layout import full_shapes
from tp_llama.checkpoint.params import read_params
from tp_llama.model import ModelArgs
from tp_llama.tokenizer import load_tokenizer


# name: (worker, ranks, environment, worker arguments)
ENGINES = {"ours TP1": ("ours", 1, {}, []), "ours TP2": ("ours", 2, {}, []),
           "ours oneDNN": ("ours", 1, {"TP_LLAMA_MATMUL": "onednn"}, []), "transformers": ("hf", 1, {}, []),
           "ours TP1 sampled": ("ours", 1, {}, ["--sample"])}
# Asked for by name (--engines): weights quantized at load.
QUANTIZED = {"ours TP1 int8": ("ours", 1, {}, ["--quantize", "int8"]),
             "ours TP1 int4": ("ours", 1, {}, ["--quantize", "int4"])}
SAMPLED = {"temperature": 0.6, "top_p": 0.9}  # the yaml's defaults


def rates(batch: int, prompt_len: int, new_tokens: int, started: float, first: float, last: float) -> dict:
    """Prompt tokens/s up to the first new token, and new tokens/s after it (the same for every engine)."""
    return {
        "prefill_tok_s": batch * prompt_len / (first - started),
        "decode_tok_s": batch * (new_tokens - 1) / (last - first),
    }


def measure(run_once: Callable[[int], tuple[float, float, float, list[list[int]]]], batches: list[int],
            prompt_len: int, new_tokens: int, repeats: int) -> list[dict]:
    """Median rates over repeats per batch size; run_once(batch) -> (start, first token, last token, tokens)."""
    results = []
    for batch in batches:
        runs = [run_once(batch) for _ in range(repeats)]
        samples = [rates(batch, prompt_len, new_tokens, *run[:3]) for run in runs]
        results.append({
            "batch": batch,
            **{key: statistics.median(s[key] for s in samples) for key in samples[0]},
            "samples": samples,
            "tokens": runs[-1][3],
        })
    return results


def decode_weight_bytes(args: ModelArgs, elt: int = 4) -> int:
    """Bytes of weights one decode step reads: all of them but the embedding table (B rows only)."""
    return sum(torch.Size(s).numel() * elt for k, s in full_shapes(args).items() if k != "tok_embeddings.weight")


def kv_cache_bytes(args: ModelArgs, batch: int, context: float, elt: int = 4) -> float:
    """Bytes of keys and values a decode step reads: every layer, every row, `context` positions each."""
    return args.n_layers * batch * 2 * args.n_kv_heads * args.head_dim * context * elt


def run_ours(ckpt: Path, batches: list[int], prompt_len: int, new_tokens: int, repeats: int, dtype: str,
             sample: bool = False, quantize: str = "none") -> dict:
    """Engine.generate on every rank; per-step times come from its on_step callback. sample: the
    yaml's default temperature and top_p, a seed per row, rather than greedy; quantize: as the yaml's."""
    engine = Engine.load(EngineConfig(str(ckpt), "tp", dtype, max_seq_len=prompt_len + new_tokens,
                                      max_batch_size=max(batches), prefill_budget=max(batches) * prompt_len,
                                      quantize=quantize))
    warm = prompts(engine.args, 1, 16)[0]
    engine.generate([Sequence("warm", warm, SamplingParams(4, ignore_eos=True))])

    def run_once(batch: int) -> tuple[float, float, float, list[list[int]]]:
        stamps: list[float] = []
        seqs = [Sequence(str(i), p, SamplingParams(new_tokens, ignore_eos=True, seed=i, **(SAMPLED if sample else {})))
                for i, p in enumerate(prompts(engine.args, batch, prompt_len))]
        started = time.perf_counter()
        engine.generate(seqs, on_step=lambda _: stamps.append(time.perf_counter()))
        if engine.rank != 0:  # the other ranks follow rank 0's plans; only rank 0's times are reported
            return 0.0, 1.0, 2.0, []
        return started, stamps[0], stamps[-1], [s.output for s in seqs]

    results = measure(run_once, batches, prompt_len, new_tokens, repeats)
    return {"load_s": engine.load_s, "threads": torch.get_num_threads(), "results": results}


class StepTimes:
    """A transformers streamer that only notes when each batch of tokens comes out."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf(ckpt: Path, batches: list[int], prompt_len: int, new_tokens: int, repeats: int, dtype: str) -> dict:
    """LlamaForCausalLM.generate, greedy, exactly new_tokens tokens per row."""
    from transformers import GenerationConfig, LlamaForCausalLM

    started = time.perf_counter()
    args = read_params(ckpt, load_tokenizer(ckpt / "tokenizer.model").n_words)
    paths = find_shards(ckpt)
    if len(paths) != 1:
        raise ValueError("the transformers baseline reads an MP 1 checkpoint")
    model = LlamaForCausalLM(hf_config(args, prompt_len + new_tokens)).eval()
    model.load_state_dict(meta_to_hf(load_shard(paths[0]), args), strict=True)
    model = model.to(getattr(torch, dtype))
    load_s = time.perf_counter() - started
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor(prompts(args, 1, 16)), generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0))

        def run_once(batch: int) -> tuple[float, float, float, list[list[int]]]:
            ids = torch.tensor(prompts(args, batch, prompt_len))
            timer = StepTimes()
            started = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=timer)
            # stamps[0] is the prompt being handed over; stamps[1] the first new token.
            return started, timer.stamps[1], timer.stamps[-1], out[:, prompt_len:].tolist()

        results = measure(run_once, batches, prompt_len, new_tokens, repeats)
    return {"load_s": load_s, "threads": torch.get_num_threads(), "results": results}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quarter")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="launches of each engine, taking turns")
    parser.add_argument("--repeats", type=int, default=1, help="generations per batch size in each launch")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both engines")
    parser.add_argument("--out", default="generate", help="name of the JSON under bench/out/")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES) + ["before TP1"], metavar="ENGINE",
                        help=f"which to run: {', '.join([*ENGINES, *QUANTIZED])}, before TP1 (needs --before)")
    parser.add_argument("--before", help="older checkout to run as 'before TP1': a folder or a commit")
    parser.add_argument("--worker", choices=("ours", "hf"), help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--sample", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quantize", default="none", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.worker:
        if a.worker == "ours":
            result = run_ours(a.ckpt, a.batches, a.prompt_len, a.new_tokens, a.repeats, a.dtype, a.sample,
                              a.quantize)
        else:
            result = run_hf(a.ckpt, a.batches, a.prompt_len, a.new_tokens, a.repeats, a.dtype)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(json.dumps(result), flush=True)
        return

    ckpt = ensure_checkpoint(PRESETS[a.preset], mp=1)
    args = read_params(ckpt)
    bandwidths = [stream_bandwidth_gbs()]
    bandwidth = bandwidths[0]
    elt = torch.tensor([], dtype=getattr(torch, a.dtype)).element_size()
    weight_bytes = decode_weight_bytes(args, elt)
    floor_tok_s = bandwidth * 1e9 / weight_bytes
    print(f"memory bandwidth {bandwidth:.1f} GB/s; {weight_bytes / 1e6:.0f} MB of {a.dtype} weights per decode step "
          f"-> batch-1 decode floor {floor_tok_s:.1f} tok/s", flush=True)
    common = ["--ckpt", str(ckpt), "--batches", *map(str, a.batches),
              "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens), "--repeats", str(a.repeats),
              "--dtype", a.dtype]
    known = {**ENGINES, **QUANTIZED}
    engines_run = [(name, *known[name], REPO) for name in a.engines if name in known]
    if a.before and "before TP1" in a.engines:
        engines_run.append(("before TP1", "ours", 1, {}, [], before_root(a.before)))
    launches: dict[str, list[dict]] = {name: [] for name, *_ in engines_run}
    for _ in range(a.rounds):  # engines take turns, so a change in the machine's load hits all of them
        for name, worker, nproc, env, extra, root in engines_run:
            bandwidths.append(stream_bandwidth_gbs())
            out = last_json(torchrun(module_in(root, "bench.engine.generate", "bench.bench_generate"), ["--worker", worker, *common, *extra], nproc, timeout=900,
                                     env=env, repo=root))
            launches[name].append(out)
            print(f"{name}: " + ", ".join(f"batch {r['batch']} prefill {r['prefill_tok_s']:.0f} decode "
                                          f"{r['decode_tok_s']:.1f} tok/s" for r in out["results"]), flush=True)
    engines = {name: pooled(outs) for name, outs in launches.items()}

    agree = {n: [agreement(engines["ours TP1"]["results"][i]["tokens"], engines[n]["results"][i]["tokens"])
                 for i in range(len(a.batches))] for n in engines if n != "ours TP1"}
    context = a.prompt_len + a.new_tokens / 2
    kv_bytes = {str(b): kv_cache_bytes(args, b, context, elt) for b in a.batches}
    for engine in engines.values():
        for r in engine["results"]:
            del r["tokens"]
    data = {
        "preset": a.preset, "dtype": a.dtype, "ckpt": str(ckpt), "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
        "rounds": a.rounds, "repeats": a.repeats,
        "bandwidth_gbs": max(bandwidths), "bandwidth_samples_gbs": bandwidths, "decode_weight_bytes": weight_bytes,
        "floor_tok_s": max(bandwidths) * 1e9 / weight_bytes,
        "kv_cache_bytes": kv_bytes,
        "agreement_with_tp1": agree, "engines": engines,
    }
    path = write_json(a.out, data)
    print(report(data))
    print(f"raw numbers: {path}")


def floors_ms(data: dict, batch: int) -> tuple[float, float]:
    """A decode step's floor in ms: its weights alone, and its weights plus its KV cache, over the bandwidth."""
    bandwidth = floors_bandwidth(data) * 1e9
    weights = data["decode_weight_bytes"]
    kv = data.get("kv_cache_bytes", {}).get(str(batch), 0.0)
    return 1e3 * weights / bandwidth, 1e3 * (weights + kv) / bandwidth


def floors_bandwidth(data: dict) -> float:
    return data.get("bandwidth_gbs", data.get("copy_bandwidth_gbs"))


def step_ms(result: dict) -> float:
    """Time per decode step (one token for each row of the batch)."""
    return 1e3 * result["batch"] / result["decode_tok_s"]


def report(data: dict) -> str:
    """The generation table and its notes, from the JSON."""
    engines = data["engines"]
    rows = []
    for i, tp1 in enumerate(engines["ours TP1"]["results"]):
        weights_floor, full_floor = floors_ms(data, tp1["batch"])
        for name, engine in engines.items():
            r = engine["results"][i]
            rows.append([
                r["batch"], name, r["prefill_tok_s"], r["decode_tok_s"], r["prefill_tok_s"] / tp1["prefill_tok_s"],
                r["decode_tok_s"] / tp1["decode_tok_s"], step_ms(r), step_ms(r) / weights_floor,
                step_ms(r) / full_floor,
            ])
    headers = ["batch", "engine", "prefill tok/s", "decode tok/s", "prefill / TP1", "decode / TP1", "step ms",
               "step / weights floor", "step / (weights + KV) floor"]
    floors = ", ".join("batch {}: {:.1f} / {:.1f}".format(r["batch"], *floors_ms(data, r["batch"]))
                       for r in engines["ours TP1"]["results"])
    notes = [
        f"- Memory bandwidth {floors_bandwidth(data):.1f} GB/s (the best of a copy and a read-only stream, "
        f"2 threads, measured before every launch); one decode step reads "
        f"{data['decode_weight_bytes'] / 1e6:.0f} MB of {data.get('dtype', 'float32')} weights plus its rows' KV cache "
        f"(at the mean context, prompt + new tokens / 2). Floors in ms (weights / weights + KV): {floors}.",
        f"- Prompt {data['prompt_len']} tokens, {data['new_tokens']} new tokens, greedy; medians of "
        f"{data['rounds'] * data['repeats']} generations per batch size ({data['rounds']} launches of each engine, "
        f"taking turns). Greedy tokens identical to "
        f"ours TP1 for the first N tokens (per batch size): {data['agreement_with_tp1']}.",
    ]
    return table(headers, rows) + "\n\n" + "\n".join(notes)


def targets(data: dict) -> list[tuple[str, str, bool]]:
    """(target, measured, met): TP1 vs transformers, batch-1 decode vs the floor, TP2 vs TP1."""
    engines = data["engines"]
    out = []
    for i, tp1 in enumerate(engines["ours TP1"]["results"]):
        hf, tp2, batch = engines["transformers"]["results"][i], engines["ours TP2"]["results"][i], tp1["batch"]
        for phase in ("prefill", "decode"):
            key = f"{phase}_tok_s"
            out.append((f"generate batch {batch} {phase}: TP1 at least as fast as transformers",
                        f"{tp1[key] / hf[key]:.2f}x", tp1[key] >= hf[key]))
            out.append((f"generate batch {batch} {phase}: TP2 no slower than 0.9x TP1",
                        f"{tp2[key] / tp1[key]:.2f}x", tp2[key] >= 0.9 * tp1[key]))
        ratio = step_ms(tp1) / floors_ms(data, batch)[1]
        out.append((f"generate batch {batch} decode: TP1 step within 1.3x of the (weights + KV) floor",
                    f"{ratio:.2f}x", ratio <= 1.3))
    return out


if __name__ == "__main__":
    main()
