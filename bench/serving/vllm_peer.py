"""vLLM's CPU build as a peer server on the same weights as ours (for bench/serving/serve.py).

    bash bench/setup_vllm.sh                              # once: bench/out/vllm-venv
    python -m bench.serving.vllm_peer convert --ckpt DIR --out HF_DIR   # run with the vLLM venv's python
    python -m bench.serving.vllm_peer tokenizer --model tokenizer.model --out TOKENIZER_DIR   # the same

Two halves, for two interpreters:
- `convert` runs in the vLLM venv (it has transformers and safetensors; the project's .venv need
  not): a Meta-layout MP 1 checkpoint -> a Hugging Face LlamaForCausalLM folder (config.json and
  model.safetensors), with bench/lib/hf_convert.py's meta_to_hf (the per-head q/k row permutation) and
  hf_config. No tokenizer files: the server runs with --skip-tokenizer-init and gets token ids.
- `tokenizer` (vLLM venv too) writes Meta's Llama 3 tokenizer.model as Hugging Face tokenizer files in a
  folder of their own (hf_convert.write_llama3_tokenizer), for the runs where vLLM must tokenize:
  structured outputs compile over its tokenizer. VLLMServer(tokenizer=DIR) passes `--tokenizer DIR`
  instead of --skip-tokenizer-init; the weights' folder stays as the other scenarios use it.
- VLLMServer and vllm_stream run in the project's .venv: start
  `python -m vllm.entrypoints.openai.api_server` from the vLLM venv with tcmalloc and the venv's
  libiomp5.so preloaded, wait until it answers, stream /v1/completions, stop the process group.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.lib.common import OUT, REPO
from bench.serving.clients import openai_stream
from bench.serving.peer_process import PeerProcess

VLLM_VENV = Path(os.environ.get("VLLM_VENV", OUT / "vllm-venv"))
SERVED_NAME = "bench"


# ---------------------------------------------------------------------------- conversion (vLLM venv)

def convert(ckpt: Path, out: Path, max_len: int) -> Path:
    """Write out/config.json and out/model.safetensors from the MP 1 checkpoint `ckpt`, once."""
    import torch
    from safetensors.torch import save_file

    from bench.lib.hf_convert import hf_config, meta_to_hf
    from tp_llama.checkpoint.shards import find_shards, load_shard
    from tp_llama.checkpoint.params import read_params
    from tp_llama.tokenizer import load_tokenizer

    stamp = out / "bench-source.json"
    paths = find_shards(ckpt)
    if len(paths) != 1:
        raise ValueError(f"{ckpt}: the conversion reads an MP 1 checkpoint, found {len(paths)} shards")
    want = json.dumps({"ckpt": str(ckpt.resolve()), "mtime": paths[0].stat().st_mtime, "max_len": max_len})
    if stamp.is_file() and stamp.read_text() == want:
        return out
    args = read_params(ckpt, load_tokenizer(ckpt / "tokenizer.model").n_words)
    state = meta_to_hf(load_shard(paths[0]), args)
    out.mkdir(parents=True, exist_ok=True)
    # Llama 3.1 rope scaling stretches 8192 original positions to 131072 (its config's
    # max_position_embeddings; transformers warns below that). vLLM's --max-model-len still caps the length.
    config = hf_config(args, max(max_len, 131072) if args.use_scaled_rope else max_len)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    save_file({k: v.to(torch.float32).contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    stamp.write_text(want)
    return out


def convert_in_venv(ckpt: Path, out: Path, max_len: int, venv: Path = VLLM_VENV) -> Path:
    """Run `convert` with the vLLM venv's python (from the project's .venv)."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python} missing: run bash bench/setup_vllm.sh first")
    command = [str(python), "-m", "bench.serving.vllm_peer", "convert", "--ckpt", str(ckpt), "--out", str(out),
               "--max-len", str(max_len)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run(command, check=True, cwd=REPO, env=env, timeout=900)
    return out


def tokenizer_in_venv(tokenizer_model: Path, out: Path, venv: Path = VLLM_VENV) -> Path:
    """Run `tokenizer` with the vLLM venv's python (from the project's .venv), once per tokenizer.model."""
    stamp = out / "bench-source.json"
    want = json.dumps({"model": str(tokenizer_model.resolve()), "mtime": tokenizer_model.stat().st_mtime})
    if stamp.is_file() and stamp.read_text() == want:
        return out
    command = [str(venv / "bin" / "python"), "-m", "bench.serving.vllm_peer", "tokenizer", "--model",
               str(tokenizer_model), "--out", str(out)]
    subprocess.run(command, check=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=900)
    stamp.write_text(want)
    return out


# ---------------------------------------------------------------------------- server (project .venv)

def preloads(venv: Path = VLLM_VENV) -> str:
    """tcmalloc (Debian's libtcmalloc-minimal4) and the venv's Intel OpenMP, as vLLM's CPU backend wants."""
    found = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    tcmalloc = next((line.split()[-1] for line in found.splitlines() if "libtcmalloc_minimal.so" in line), None)
    iomp = next(iter(sorted(venv.rglob("libiomp5.so"))), None)
    if tcmalloc is None or iomp is None:
        raise FileNotFoundError(f"tcmalloc ({tcmalloc}) or libiomp5.so ({iomp}) missing: run bash bench/setup_vllm.sh")
    return f"{tcmalloc}:{iomp}"


class VLLMServer(PeerProcess):
    """One vLLM OpenAI-compatible server on loopback; use as a context manager."""

    name = "vLLM"
    poll_s = 1.0  # it compiles the model first: about a minute here

    def __init__(self, hf_dir: Path, port: int, workdir: Path, dtype: str, max_model_len: int,
                 cores: str = "0-1", kv_gib: int = 1, extra_args: list[str] | None = None,
                 venv: Path = VLLM_VENV, prefix_caching: bool = False, tokenizer: Path | None = None) -> None:
        super().__init__(port, workdir, "vllm.log")
        self.command = [
            str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(hf_dir), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            *(["--tokenizer", str(tokenizer)] if tokenizer else ["--skip-tokenizer-init"]),
            "--max-model-len", str(max_model_len),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            *(extra_args or []),
        ]
        self.env = dict(os.environ, LD_PRELOAD=preloads(venv), VLLM_CPU_OMP_THREADS_BIND=cores,
                        VLLM_CPU_KVCACHE_SPACE=str(kv_gib), TMPDIR=str(workdir / "tmp"))
        self.env.pop("PYTHONPATH", None)

    def start(self) -> None:
        (self.workdir / "tmp").mkdir(parents=True, exist_ok=True)
        super().start()


def vllm_stream(port: int, prompt_ids: list[int], max_tokens: int, timeout: float = 600,
                fields: dict | None = None) -> dict:
    """One streaming /v1/completions request to vLLM (token ids come back with return_token_ids);
    `fields` override the request's (sampling settings)."""
    return openai_stream(port, "/v1/completions", prompt_ids, max_tokens, {}, {"model": SERVED_NAME,
                         "return_token_ids": True, **(fields or {})}, timeout)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="Meta MP 1 checkpoint -> Hugging Face folder (run in the vLLM venv)")
    conv.add_argument("--ckpt", type=Path, required=True)
    conv.add_argument("--out", type=Path, required=True)
    conv.add_argument("--max-len", type=int, default=2048)
    tok = sub.add_parser("tokenizer", help="Llama 3 tokenizer.model -> Hugging Face tokenizer files (vLLM venv)")
    tok.add_argument("--model", type=Path, required=True)
    tok.add_argument("--out", type=Path, required=True)
    a = parser.parse_args(argv)
    if a.command == "convert":
        print(convert(a.ckpt, a.out, a.max_len))
    elif a.command == "tokenizer":
        from bench.lib.hf_convert import write_llama3_tokenizer

        print(write_llama3_tokenizer(a.model, a.out))


if __name__ == "__main__":
    sys.exit(main())
