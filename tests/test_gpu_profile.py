"""bench/gpu_profile.py, which runs only where a GPU is lent: keep every path of it working here on the CPU,
and its kernel categories true to the kernel names an H200 run printed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench import gpu_attention
from bench.gpu_profile import category
from tp_llama.model.kv_cache import decode_splits

H200_KERNELS = {  # names from the profile's tables on an H200 (torch 2.11), and what each kernel is
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1": "matmul",
    "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT": "matmul",
    "triton_tem_fused__to_copy_add_copy_flex_attention_floor_divide_0": "attention",
    "triton_per_fused__to_copy_add_copy_flex_attention_floor_divide_1": "attention",
    "triton_poi_fused__to_copy_add_index_index_put_mul_slice_split_with_sizes_stack_2": "KV-cache write",
    "triton_red_fused__fused_rms_norm_embedding_0": "norm (+ residual add)",
    "triton_poi_fused_mul_silu_split_10": "SwiGLU",
    "triton_poi_fused__to_copy_add_index_mul_slice_split_with_sizes_stack_sub_3": "RoPE",
    "triton_poi_fused_copy_slice_view_zeros_5": "block mask / step inputs",
    "memcpy32_post": "copies / casts",
}


@pytest.mark.parametrize("name", list(H200_KERNELS))
def test_each_kernel_lands_in_its_category(name: str):
    assert category(name) == H200_KERNELS[name]


def test_the_profile_runs_here_on_cpu():
    """--fp8 too: on the CPU, torch._scaled_mm runs Meta's fp8 layers as on a GPU (the loader never does here).
    One row count (2 rows: the step pads none and reads two rows' blocks) runs every line a second would."""
    run = subprocess.run([sys.executable, "-m", "bench.gpu_profile", "--device", "cpu", "--small", "--rows", "2",
                          "--context", "40", "--prompt", "48", "--fp8"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.count("### ") == 2 and "GPU idle within the step" in run.stdout, run.stdout


@pytest.mark.parametrize("rows, want", [(1, 33), (2, 16), (16, 16), (17, 4), (32, 4)])
def test_decode_splits_on_an_h200(rows: int, want: int):
    """132 multiprocessors, 8 KV heads (the 8B shape at TP 1): the kernel's own two CTAs per multiprocessor
    while rows x heads leave some without one (at least 16), four parts once they fill them."""
    assert decode_splits(132, rows, 8) == want


def test_the_attention_sweep_runs_here_on_cpu(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(gpu_attention, "LAYERS", 2)  # each layer the same uncompiled call on CPU
    assert gpu_attention.main(["--device", "cpu", "--rows", "2", "--context", "24", "--blocks", "16", "--splits", "4"]) == 0
    out = capsys.readouterr().out
    assert [line.split(" | ")[:3] for line in out.splitlines() if line.startswith("| 16 ")] == [
        ["| 16", "2", "auto"], ["| 16", "2", "4"]], out
