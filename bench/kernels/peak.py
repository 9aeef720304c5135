"""This CPU's arithmetic peak for the matmuls' instructions, the ceiling every server's prefill meets.

    python -m bench.kernels.peak [--threads 2]

A loop of 12 independent sums in registers (no memory traffic) per thread, compiled with gcc for
each instruction the CPU has: float32 FMA (AVX-512 or AVX2) and bfloat16 pairs by vdpbf16ps
(avx512_bf16). GFLOPS counts a multiply and an add as two. A prefill of R rows of a model with P
matmul parameters costs 2 P R FLOPs, so this bounds any server's prompt throughput on the CPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from bench.lib.common import table
from tp_llama.kernels.cpu.build import compiler, cpu_flags

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#define SUMS 12
int main(int argc, char **argv) {
    long steps = atol(argv[1]);
    double started = omp_get_wtime();
    float sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
        VEC sums[SUMS], a = SET1(1.0f), b = SET1(1.0f + omp_get_thread_num());
        for (int i = 0; i < SUMS; i++) sums[i] = ZERO();
        for (long n = 0; n < steps; n++) {
#pragma GCC unroll 12
            for (int i = 0; i < SUMS; i++) sums[i] = STEP(sums[i], a, b);
            __asm__ volatile("" : "+v"(a)); /* a is unknown each step: the loop cannot be folded */
        }
        for (int i = 0; i < SUMS; i++) sink += FIRST(sums[i]);
    }
    double seconds = omp_get_wtime() - started;
    printf("%d %.6f %g\n", omp_get_max_threads(), seconds, sink);
    return 0;
}
"""

# name: (CPU flags, compiler flags, defines, FLOPs per instruction)
INSTRUCTIONS = {
    "vdpbf16ps zmm (bfloat16 pairs)": (
        {"avx512f", "avx512_bf16"}, ["-mavx512f", "-mavx512bf16"],
        {"VEC": "__m512", "SET1": "_mm512_set1_ps", "ZERO": "_mm512_setzero_ps",
         "STEP(s, a, b)": "_mm512_dpbf16_ps(s, (__m512bh)(a), (__m512bh)(b))", "FIRST": "_mm512_cvtss_f32"}, 64),
    "vfmadd zmm (float32)": (
        {"avx512f"}, ["-mavx512f"],
        {"VEC": "__m512", "SET1": "_mm512_set1_ps", "ZERO": "_mm512_setzero_ps",
         "STEP(s, a, b)": "_mm512_fmadd_ps(a, b, s)", "FIRST": "_mm512_cvtss_f32"}, 32),
    "vfmadd ymm (float32)": (
        {"avx2", "fma"}, ["-mavx2", "-mfma"],
        {"VEC": "__m256", "SET1": "_mm256_set1_ps", "ZERO": "_mm256_setzero_ps",
         "STEP(s, a, b)": "_mm256_fmadd_ps(a, b, s)", "FIRST": "_mm256_cvtss_f32"}, 16),
}


def peak_gflops(cc: list[str], flags: list[str], defines: dict[str, str], flops: int, threads: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as work:
        source, program = Path(work) / "peak.c", Path(work) / "peak"
        source.write_text(SOURCE)
        subprocess.run([*cc, "-O2", "-fopenmp", *flags, *(f"-D{k}={v}" for k, v in defines.items()),
                        "-o", str(program), str(source)], check=True, timeout=120)
        out = subprocess.run([str(program), str(steps)], env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                             check=True, capture_output=True, text=True, timeout=300).stdout.split()
    ran, seconds = int(out[0]), float(out[1])
    return ran * steps * 12 * flops / seconds / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--steps", type=int, default=100_000_000, help="loop steps per thread")
    a = parser.parse_args(argv)
    cc = compiler()
    if cc is None:
        raise SystemExit("no C compiler (gcc)")
    have = cpu_flags()
    rows = []
    for name, (needs, flags, defines, flops) in INSTRUCTIONS.items():
        if needs <= have:
            gflops = peak_gflops(cc, flags, defines, flops, a.threads, a.steps)
            rows.append([name, a.threads, gflops, gflops / a.threads])
    print(table(["instruction", "threads", "GFLOPS", "GFLOPS a thread"], rows))


if __name__ == "__main__":
    main()
