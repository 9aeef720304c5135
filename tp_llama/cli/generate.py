"""Offline generation, to check a checkpoint before serving it.

    torchrun --nproc-per-node N -m tp_llama.generate --ckpt-dir DIR --prompt TEXT --max-new-tokens K

Also runs as one plain process. Rank 0 prints one JSON object per prompt on stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from tp_llama.config import COMPILE, DEVICES, DTYPES, MODES, SPECULATIVE, EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.runner import CPU_DEFAULT_SEQUENCES
from tp_llama.kernels.quant import QUANTIZE
from tp_llama.engine.sampling import SamplingParams, check_params
from tp_llama.engine.sequence import Sequence, check_sequence
from tp_llama.errors import CheckpointError
from tp_llama.parallel.distributed import every_rank_agrees, leave_group, log
from tp_llama.tokenizer import load_tokenizer

SERVER = EngineConfig(ckpt_dir="-")  # the server's defaults, which bound a run's own


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", required=True, help="folder with params.json, tokenizer.model, consolidated.*.pth")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch of prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="over prompt and output (vLLM's)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past stop tokens")
    parser.add_argument("--mode", choices=MODES, default="tp")
    parser.add_argument("--device", choices=DEVICES, default="auto", help="auto: CUDA where a GPU is visible")
    parser.add_argument("--compile", choices=COMPILE, default="auto",
                        help="decode steps through torch.compile (CUDA graphs on CUDA); auto: on for CUDA")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bfloat16 on CUDA, on CPUs with native bfloat16 and where the C kernels run, else float32")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help=f"the longest sequence (default: what the prompts and --max-new-tokens can need, "
                             f"at most {SERVER.max_seq_len})")
    parser.add_argument("--slots", type=int, default=None,
                        help=f"the most sequences running at once (default: one per prompt, at most "
                             f"{SERVER.max_batch_size})")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=0.0,
                        help=f"the KV-cache pool per rank (default: {CPU_DEFAULT_SEQUENCES} sequences of --max-seq-len "
                             "on CPU, most of the free memory on a GPU)")
    parser.add_argument("--kv-block-size", type=int, default=SERVER.kv_block_size, help="positions per KV-cache block")
    parser.add_argument("--no-prefix-caching", action="store_true", help="prefill every prompt from its first token")
    parser.add_argument("--quantize", choices=QUANTIZE, default="none",
                        help="matmul weights quantized by each rank as it reads them: int8 symmetric (a scale per "
                             "group of 32 along k with the C kernels, per output row on PyTorch's ops), int4 a scale "
                             "and a minimum per group of 32 (docs/checkpoints.md)")
    parser.add_argument("--prefill-budget", type=int, default=SERVER.prefill_budget,
                        help="rows per step, decode rows included (longer prompts are prefilled in chunks)")
    parser.add_argument("--speculative", choices=SPECULATIVE, default=SERVER.speculative,
                        help="decode rows carry proposed tokens, verified several a step (replies do not change): "
                             "ngram proposes by prompt lookup, draft by a draft model's greedy tokens")
    parser.add_argument("--draft-ckpt-dir", default=None,
                        help="--speculative draft: a smaller checkpoint of the same tokenizer (default: this one "
                             "quantized int4 at load)")
    parser.add_argument("--speculative-tokens", type=int, default=SERVER.speculative_tokens,
                        help="proposals per decode row at most (ngram: twice as many after a run all taken)")
    parser.add_argument("--ngram-min", type=int, default=SERVER.ngram_min, help="the shortest suffix n-gram that proposes")
    parser.add_argument("--ngram-max", type=int, default=SERVER.ngram_max, help="the longest suffix n-gram, looked up first")
    a = parser.parse_args(argv)
    try:  # a bad sampling flag is named now, not after every rank has loaded the checkpoint
        if a.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
        check_params(sampling_params(a))
    except ValueError as exc:
        parser.error(str(exc))
    return a


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                          repetition_penalty=a.repetition_penalty, seed=a.seed, ignore_eos=a.ignore_eos)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def largest_over_ranks(value: float) -> float:
    if not dist.is_initialized():
        return value
    values: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return max(values)


def prompt_token_bound(prompt: str) -> int:
    """The most tokens `prompt` can encode to: one per UTF-8 byte (byte fallback), SentencePiece's
    leading space and BOS."""
    return len(prompt.encode()) + 2


def engine_config(a: argparse.Namespace) -> EngineConfig:
    """The run's settings; the longest sequence sized to the job where not given, not to a server.

    The server's default pool (16 sequences of 2048 positions, 0.5 GB for a 1B model) took longer to
    page in than the rest of the load.
    """
    longest = max(prompt_token_bound(prompt) for prompt in a.prompt) + a.max_new_tokens
    max_seq_len = a.max_seq_len if a.max_seq_len is not None else max(2, min(longest, SERVER.max_seq_len))
    slots = a.slots if a.slots is not None else min(len(a.prompt), SERVER.max_batch_size)
    return EngineConfig(a.ckpt_dir, a.mode, a.dtype, max_seq_len, slots, a.prefill_budget, a.device, a.compile,
                        a.kv_cache_memory_gb, a.kv_block_size, not a.no_prefix_caching, a.quantize, a.speculative,
                        a.speculative_tokens, a.ngram_min, a.ngram_max, a.draft_ckpt_dir)


def check_prompts(a: argparse.Namespace, max_seq_len: int) -> None:
    """Each prompt's tokens plus --max-new-tokens within max_seq_len, checked on every rank before any loads
    the checkpoint (only its tokenizer is read, and only where a prompt's bound does not fit): a prompt too
    long failed after the whole load."""
    if max(map(prompt_token_bound, a.prompt)) + a.max_new_tokens <= max_seq_len:
        return
    tokenizer = load_tokenizer(Path(a.ckpt_dir) / "tokenizer.model")
    for i, prompt in enumerate(a.prompt):
        n = len(tokenizer.encode(prompt, bos=True))
        if n + a.max_new_tokens > max_seq_len:
            raise ValueError(f"prompt {i + 1} ({n} tokens) plus --max-new-tokens ({a.max_new_tokens}) exceeds "
                             f"--max-seq-len {max_seq_len}")


def run(a: argparse.Namespace) -> None:
    config = engine_config(a)
    check_prompts(a, config.max_seq_len)
    engine = Engine.load(config)
    params = sampling_params(a)
    sequences = [Sequence(str(i), engine.tokenizer.encode(p, bos=True), params) for i, p in enumerate(a.prompt)]
    with every_rank_agrees():  # every rank checks the same prompts, so a bad one stops all of them before any step
        for seq in sequences:
            check_sequence(seq.prompt_ids, params, engine.config.max_seq_len)
    engine.generate(sequences)
    stats = engine.stats
    timings = {
        "load_s": round(largest_over_ranks(engine.load_s), 3),
        "prefill_tokens_per_s": round(stats.prefill_tokens / max(stats.prefill_s, 1e-9), 1),
        "decode_tokens_per_s": round(stats.decode_tokens / max(stats.decode_s, 1e-9), 1),
    }
    if a.speculative != "off":
        timings.update(proposed_tokens=stats.proposed, accepted_tokens=stats.accepted)
    rss = round(largest_over_ranks(peak_rss_mb()), 1)
    if engine.rank != 0:
        return
    for seq in sequences:
        output = {
            "text": engine.tokenizer.decode(seq.output),
            "token_ids": seq.output,
            "finish_reason": seq.finish_reason,
            "usage": {"prompt_tokens": len(seq.prompt_ids), "completion_tokens": len(seq.output),
                      "cached_prompt_tokens": seq.cached_tokens or 0},
            "preemptions": seq.preemptions,
            "timings": timings,
            "peak_rss_mb": rss,
        }
        print(json.dumps(output), flush=True)


def on_every_rank(run: Callable[[argparse.Namespace], None], a: argparse.Namespace) -> int:
    """run(a) on this rank: an error is logged as one line, not a traceback, and every rank leaves the
    process group either way; the exit status, 0 or 2."""
    error = None
    try:
        run(a)
    except (CheckpointError, ValueError, RuntimeError, OSError, MemoryError) as exc:  # MemoryError: a KV pool too small
        log(f"error: {exc}")
        error = exc
    leave_group(error)
    return 0 if error is None else 2


def main(argv: list[str] | None = None) -> int:
    return on_every_rank(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
