"""llama.cpp as bench/setup_llamacpp.sh builds it: where its programs are, running them, reading their output.

Shared by the quality tools (bench/quality/) and the SmolLM2 converter (bench/lib/smollm2.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.lib.common import OUT

LLAMACPP = Path(os.environ.get("LLAMACPP_DIR", OUT / "llama.cpp"))
BIN = LLAMACPP / "build" / "bin"
SRC = LLAMACPP / "src"

# The flags that decide which of ggml's CPU kernels run (and which of ours would): printed beside
# every table, since a number from one CPU says little about another.
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "amx_tile", "amx_int8", "amx_bf16")


def cpu_flags() -> list[str]:
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in CPU_FLAGS if f in have]
    return []


def program(name: str) -> Path:
    path = BIN / name
    if not os.access(path, os.X_OK):
        raise SystemExit(f"{path} is missing: run `bash bench/setup_llamacpp.sh` first (builds llama.cpp once)")
    return path


def run(name: str, args: list[str], timeout: float | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run one of the programs, output captured (llama.cpp logs to stderr, results to stdout)."""
    proc = subprocess.run([str(program(name)), *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-25:])
        raise RuntimeError(f"{name} {' '.join(args)} exited {proc.returncode}:\n{tail}")
    return proc


def prepare_text_like_perplexity(text: bytes) -> bytes:
    """The text llama-perplexity tokenizes for `-f FILE`: common's -f handler drops one trailing newline.

    llama-tokenize -f reads the file verbatim instead, so a file made for it gets the same cut first.
    """
    return text[:-1] if text.endswith(b"\n") else text


def tokenize(gguf: Path, text_file: Path, timeout: float = 600) -> list[int]:
    """Token ids of a text file exactly as llama-perplexity makes them from `-f text_file`.

    llama-perplexity tokenizes with the vocabulary's own BOS rule and special tokens read as plain
    text; llama-tokenize parses special tokens unless told not to and reads -f verbatim, so it
    gets the trimmed copy and --no-parse-special. Escapes are processed by both by default.
    """
    trimmed = text_file.with_name(text_file.name + ".ppl-input")
    trimmed.write_bytes(prepare_text_like_perplexity(text_file.read_bytes()))
    try:
        proc = run("llama-tokenize", ["-m", str(gguf), "-f", str(trimmed), "--ids", "--no-parse-special",
                                      "--log-disable"], timeout=timeout)
    finally:
        trimmed.unlink()
    body = proc.stdout.strip()
    match = re.search(r"\[([\d,\s]*)\]\s*$", body)
    if not match:
        raise RuntimeError(f"llama-tokenize printed no id list: {body[-300:]!r}")
    return [int(x) for x in match.group(1).replace(",", " ").split()]


@dataclass
class PerplexityRun:
    ppl: float
    ppl_err: float | None
    chunks: int
    seconds: float  # wall time of the whole program: load, tokenize and every chunk
    seconds_per_pass: float | None  # llama.cpp's timing of its first pass (n_seq chunks side by side)
    n_seq: int  # chunks one pass evaluates together (its batch size over ctx)
    tokens_per_second: float | None  # prompt tokens a second, from llama.cpp's performance log
    log: str

    @property
    def seconds_per_chunk(self) -> float | None:
        return self.seconds_per_pass / self.n_seq if self.seconds_per_pass else None


_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+)(?: \+/- ([0-9.]+))?")
_PASS = re.compile(r"([0-9.]+) seconds per pass")
_CHUNKS = re.compile(r"perplexity over (\d+) chunks, n_ctx=\d+, batch_size=\d+, n_seq=(\d+)")
_EVAL = re.compile(r"prompt eval time =\s*[0-9.]+ ms /\s*\d+ tokens \([^,]*,\s*([0-9.]+) tokens per second\)")


def perplexity(gguf: Path, text_file: Path, ctx: int = 512, chunks: int | None = None, threads: int = 2,
               extra: list[str] | None = None, timeout: float | None = None) -> PerplexityRun:
    """llama-perplexity's final estimate (each chunk of ctx tokens scored on its second half)."""
    args = ["-m", str(gguf), "-f", str(text_file), "-c", str(ctx), "-t", str(threads), "-tb", str(threads)]
    if chunks:
        args += ["--chunks", str(chunks)]
    started = time.perf_counter()
    proc = run("llama-perplexity", args + (extra or []), timeout=timeout)
    seconds = time.perf_counter() - started
    log = proc.stdout + proc.stderr
    final = _FINAL.search(log)
    if not final:
        raise RuntimeError(f"llama-perplexity printed no final estimate:\n{log[-2000:]}")
    n = _CHUNKS.search(log)
    per_pass, rate = _PASS.search(log), _EVAL.search(log)
    return PerplexityRun(
        ppl=float(final.group(1)),
        ppl_err=float(final.group(2)) if final.group(2) else None,
        chunks=int(n.group(1)) if n else (chunks or 0),
        seconds=seconds,
        seconds_per_pass=float(per_pass.group(1)) if per_pass else None,
        n_seq=int(n.group(2)) if n else 1,
        tokens_per_second=float(rate.group(1)) if rate else None,
        log=log,
    )


def quantize(src: Path, dst: Path, kind: str, threads: int = 2, timeout: float | None = None) -> float:
    """llama-quantize SRC DST KIND (Q8_0, Q4_0, Q4_K_M, ...); seconds taken. Skips a DST already made."""
    if dst.exists() and dst.stat().st_mtime >= src.stat().st_mtime:
        return 0.0
    tmp = dst.with_name(dst.name + ".part")
    started = time.perf_counter()
    run("llama-quantize", [str(src), str(tmp), kind, str(threads)], timeout=timeout)
    tmp.rename(dst)
    return time.perf_counter() - started
