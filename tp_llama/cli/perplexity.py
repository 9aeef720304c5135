"""Perplexity of a checkpoint on a text, measured the way llama.cpp's `llama-perplexity` measures it.

    python -m tp_llama.cli.perplexity --ckpt-dir DIR --text FILE [--ctx 512] [--chunks N] [--quantize int8]
    torchrun --nproc-per-node N -m tp_llama.cli.perplexity --ckpt-dir DIR --ids FILE ...

The text is encoded with BOS (or --ids FILE gives token ids another tokenizer made: integers
separated by whitespace or commas, so a JSON list reads too). The ids are cut into chunks of --ctx
tokens (the tail that fills no chunk is left out; at least two chunks are needed); each chunk's first
token is replaced by BOS (--no-bos keeps it), each chunk is run on its own from position 0, and the
tokens of its second half are scored: the log-probability of the token at each position j + 1 for j
from ctx/2 to ctx - 2, given the chunk's tokens before it. PPL = exp(mean negative log-likelihood),
and its +/- is llama.cpp's: the standard error of the mean times PPL.

The engine scores the chunks as prompts with prompt log-probabilities (the same step path as the
OpenAI API's echo): under TP only each position's log-probability and top-1 cross ranks.
Progress goes to stderr, one cumulative PPL per chunk as llama.cpp prints it; the final estimate to
stdout. --json OUT writes the summary, each scored token's log-probability and the model's top-1
ids; --compare-to OUT2 (another run's --json, say unquantized) adds how often the top-1 ids agree.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

from tp_llama.cli.generate import SERVER, on_every_rank
from tp_llama.config import DEVICES, DTYPES, MODES, EngineConfig
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.kernels.quant import QUANTIZE
from tp_llama.parallel.distributed import log
from tp_llama.tokenizer import Tokenizer, load_tokenizer

DEFAULT_SLOTS = 4  # chunks running at once: a step's rows come from several chunks when --prefill-budget allows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", required=True, help="folder with params.json, tokenizer.model, consolidated.*.pth")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="a UTF-8 text file, encoded with the checkpoint's tokenizer (BOS first)")
    source.add_argument("--ids", help="a file of token ids, separated by whitespace or commas (a JSON list reads too)")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama.cpp's -c)")
    parser.add_argument("--chunks", type=int, default=None, help="score only the first N chunks")
    parser.add_argument("--no-bos", action="store_true", help="keep each chunk's first token (a vocabulary "
                                                              "llama.cpp adds no BOS to)")
    parser.add_argument("--quantize", choices=QUANTIZE, default="none", help="matmul weights quantized at load")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the engine's, as in generate")
    parser.add_argument("--mode", choices=MODES, default="tp")
    parser.add_argument("--device", choices=DEVICES, default="auto", help="auto: CUDA where a GPU is visible")
    parser.add_argument("--slots", type=int, default=None, help=f"chunks running at once (default {DEFAULT_SLOTS})")
    parser.add_argument("--prefill-budget", type=int, default=SERVER.prefill_budget, help="rows per step")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=0.0, help="the KV-cache pool per rank (0: auto)")
    parser.add_argument("--json", dest="json_out", default=None, help="write the summary and per-token results here")
    parser.add_argument("--compare-to", default=None, help="another run's --json: report top-1 agreement with it")
    return parser.parse_args(argv)


def read_ids(text: str) -> list[int]:
    """Integers separated by whitespace or commas, optionally inside one pair of brackets."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    ids = []
    for word in (w for w in re.split(r"[\s,]+", body) if w):
        try:
            ids.append(int(word))
        except ValueError:  # not an integer, or more digits than int() reads (sys.get_int_max_str_digits)
            raise ValueError(f"--ids: {word[:20]!r} is not an integer token id") from None
    return ids


def chunk_ids(ids: list[int], ctx: int, chunks: int | None, bos: int | None) -> list[list[int]]:
    """llama.cpp's chunks: consecutive runs of ctx ids (a tail shorter than ctx dropped), each
    starting with BOS instead of its first id when bos is given."""
    if ctx < 4:
        raise ValueError(f"--ctx must be >= 4, got {ctx}")
    if len(ids) < 2 * ctx:
        raise ValueError(f"need at least {2 * ctx} tokens for a context of {ctx}; the input has {len(ids)}")
    n = len(ids) // ctx if chunks is None else min(chunks, len(ids) // ctx)
    if n < 1:
        raise ValueError(f"--chunks must be >= 1, got {chunks}")
    out = [ids[i * ctx : (i + 1) * ctx] for i in range(n)]
    return [[bos] + chunk[1:] if bos is not None else chunk for chunk in out]


def scored_entries(seq: Sequence, ctx: int) -> list[Any]:
    """The second half's entries: the prompt log-probabilities of positions ctx/2 .. ctx - 2 (tokens
    ctx/2 + 1 .. ctx - 1)."""
    return seq.prompt_logprobs[ctx // 2 :]


class Tally:
    """llama.cpp's running sums: negative log-likelihood and its square over the tokens scored."""

    def __init__(self) -> None:
        self.nll = self.nll2 = 0.0
        self.count = 0

    def add(self, logprobs: list[float]) -> None:
        for value in logprobs:
            self.nll -= value
            self.nll2 += value * value
        self.count += len(logprobs)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    def estimate(self) -> tuple[float, float]:
        """(PPL, its +/-: the standard error of the mean NLL times PPL)."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        error = math.sqrt(var / (self.count - 1)) if var > 0 and self.count > 1 else 0.0
        return math.exp(mean), error * math.exp(mean)


def read_top1(other_file: str, chunks: int, ctx: int) -> list[list[int]]:
    """Another run's top-1 ids (its --json), checked to cover the same chunks as this run."""
    try:
        data = json.loads(Path(other_file).read_text(encoding="utf-8"))
        other, other_ctx = data["top1"], data.get("ctx", ctx)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"--compare-to {other_file}: not a --json file of this command ({exc})") from None
    per_chunk = ctx - 1 - ctx // 2
    shape = [len(c) if isinstance(c, list) else -1 for c in other] if isinstance(other, list) else None
    if other_ctx != ctx or shape != [per_chunk] * chunks:
        raise ValueError(f"--compare-to {other_file}: its chunks differ from this run's ({chunks} of {per_chunk} "
                         "scored tokens): use the same ids, --ctx and --chunks")
    return other


def agreement(top1: list[list[int]], other: list[list[int]]) -> tuple[int, int]:
    """(positions whose top-1 ids agree, positions compared)."""
    same = sum(a == b for mine, theirs in zip(top1, other) for a, b in zip(mine, theirs))
    return same, sum(len(c) for c in top1)


def load_ids(a: argparse.Namespace, tokenizer: Tokenizer) -> list[int]:
    if a.text is not None:
        return tokenizer.encode(Path(a.text).read_text(encoding="utf-8"), bos=not a.no_bos)
    ids = read_ids(Path(a.ids).read_text(encoding="utf-8"))
    bad = [i for i in ids if not 0 <= i < tokenizer.n_words]
    if bad:
        raise ValueError(f"--ids: token id {bad[0]} lies outside the vocabulary [0, {tokenizer.n_words})")
    return ids


def run(a: argparse.Namespace) -> None:
    # Every rank reads and checks the same input before the model loads: a bad one stops them all at once.
    tokenizer = load_tokenizer(Path(a.ckpt_dir) / "tokenizer.model")
    chunks = chunk_ids(load_ids(a, tokenizer), a.ctx, a.chunks, None if a.no_bos else tokenizer.bos_id)
    other = read_top1(a.compare_to, len(chunks), a.ctx) if a.compare_to is not None else None
    if a.json_out is not None and not Path(a.json_out).resolve().parent.is_dir():
        raise ValueError(f"--json {a.json_out}: its folder does not exist")
    if a.json_out is not None and Path(a.json_out).is_dir():
        raise ValueError(f"--json {a.json_out}: a folder, not a file")
    slots = a.slots if a.slots is not None else DEFAULT_SLOTS
    config = EngineConfig(a.ckpt_dir, a.mode, a.dtype, max(a.ctx, 2), slots, a.prefill_budget, a.device, "off",
                          a.kv_cache_memory_gb, prefix_caching=False, quantize=a.quantize)
    engine = Engine.load(config)
    params = SamplingParams(0, prompt_logprobs=1)
    sequences = [Sequence(str(i), chunk, params) for i, chunk in enumerate(chunks)]
    tally, shown = Tally(), 0

    def progress(_touched: list[Sequence]) -> None:
        nonlocal shown
        while shown < len(sequences) and sequences[shown].finished:
            tally.add([e.logprob for e in scored_entries(sequences[shown], a.ctx)])
            shown += 1
            sys.stderr.write(f"[{shown}]{tally.ppl:.4f},")
            sys.stderr.flush()

    started = time.perf_counter()
    engine.generate(sequences, on_step=progress)
    if engine.rank != 0:
        return
    sys.stderr.write("\n")
    seconds = time.perf_counter() - started
    log(f"scored {len(chunks)} chunks of {a.ctx} tokens in {seconds:.1f} s "
        f"({len(chunks) * a.ctx / max(seconds, 1e-9):.1f} tokens/s)")
    ppl, error = tally.estimate()
    print(f"Final estimate: PPL = {ppl:.4f} +/- {error:.5f}", flush=True)
    top1 = [[e.top[0][0] for e in scored_entries(seq, a.ctx)] for seq in sequences]
    summary: dict[str, Any] = {"ppl": ppl, "ppl_error": error, "mean_nll": tally.nll / tally.count,
                               "tokens_scored": tally.count, "chunks": len(chunks), "ctx": a.ctx,
                               "quantize": a.quantize, "bos": not a.no_bos}
    if other is not None:
        same, total = agreement(top1, other)
        summary["top1_agreement"] = same / total
        print(f"top-1 agreement with {a.compare_to}: {100 * same / total:.2f}% ({same} of {total})", flush=True)
    if a.json_out is not None:
        logprobs = [[e.logprob for e in scored_entries(seq, a.ctx)] for seq in sequences]
        Path(a.json_out).write_text(json.dumps({**summary, "token_logprobs": logprobs, "top1": top1}) + "\n")


def main(argv: list[str] | None = None) -> int:
    return on_every_rank(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
