"""llama.cpp's llama-server as a peer server on the same weights as ours (for bench/serving/serve.py).

    bash bench/setup_llamacpp.sh                                    # once: bench/out/llama.cpp
    python -m bench.serving.llamacpp_peer gguf --preset llama3.2-1b [--kinds f32 bf16 q8_0 q4_0 q4_k_m]
    python -m bench.serving.llamacpp_peer parity --preset quarter [--prompt-len 32] [--tokens 16]

- GGUFs: the MP 1 checkpoint of a preset becomes an F32 GGUF once (bench/lib/meta_gguf.py, gguf-py
  directly, no Hugging Face folder), and llama.cpp's own `llama-quantize` makes BF16, Q8_0, Q4_0 and
  Q4_K_M from it with its default choices (Q4_0 and Q4_K_M put the output layer in Q6_K, Q4_K_M some
  of the FFN-down and V matrices too).
  Kept in bench/out/gguf/CKPT_NAME/model-KIND.gguf, redone when the checkpoint, the converter or
  llama.cpp's version changes.
- LlamaServer: `llama-server -m GGUF -t T -tb T -np SLOTS -c SLOTS*CTX --cont-batching` on loopback,
  a slot per client of the largest level, prompt caching off (`--no-cache-prompt --cache-ram 0` and
  `"cache_prompt": false` per request: every request sends one prompt, and ours and vLLM run with
  prefix caching off too).
- llamacpp_stream: one streaming POST /completion with the prompt as token ids, "n_predict",
  "ignore_eos"; TTFT is the first chunk that carries a token. llama-server holds back a token whose
  bytes end inside a UTF-8 character until a later one completes it, so a reply's first chunk can
  come a token late; the token count is the final chunk's tokens_predicted, not the chunks.
- parity: greedy tokens of llama.cpp on the F32 GGUF (f32 KV cache, flash attention off) against
  `python -m tp_llama.generate --dtype float32` on the checkpoint, for a prompt text whose ids (our
  tokenizer's) llama.cpp gets as ids; also whether llama.cpp's /tokenize makes the same ids of the text.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
from pathlib import Path

from bench.lib import llamacpp
from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.common import OUT, last_json, run_module
from bench.lib.generation import common_prefix, prompt_text
from bench.serving.clients import post_json, sse_chunks
from bench.serving.peer_process import PeerProcess

GGUF_HOME = OUT / "gguf"
# Server name suffix -> llama-quantize's type (f32: the converted file itself).
KINDS = {"f32": None, "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}
# What a float32 reference needs from llama.cpp: no flash attention, an f32 KV cache.
EXACT = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]


def version() -> str:
    stamp = llamacpp.SRC / ".version"
    return f"b{stamp.read_text().strip()}" if stamp.is_file() else "unknown"


# ---------------------------------------------------------------------------- GGUFs

def gguf_for(ckpt: Path, kind: str, threads: int = 2) -> Path:
    """The GGUF of the MP 1 checkpoint `ckpt` in `kind` (a KINDS key), made once."""
    from bench.lib.meta_gguf import FORMAT, write_gguf  # torch and gguf-py: only where a GGUF is made

    if kind not in KINDS:
        raise ValueError(f"GGUF kind {kind!r}: one of {', '.join(KINDS)}")
    folder = GGUF_HOME / ckpt.name
    f32, stamp = folder / "model-f32.gguf", folder / "bench-source.json"
    shard = ckpt / "consolidated.00.pth"
    want = json.dumps({"ckpt": str(ckpt.resolve()), "mtime": shard.stat().st_mtime, "format": FORMAT,
                       "llamacpp": version()})
    if not (f32.is_file() and stamp.is_file() and stamp.read_text() == want):
        for old in folder.glob("model-*.gguf"):
            old.unlink()
        print(f"[llamacpp] writing {f32} (once)", flush=True)
        write_gguf(ckpt, f32)
        stamp.write_text(want)
    if KINDS[kind] is None:
        return f32
    dst = folder / f"model-{kind}.gguf"
    if not dst.is_file():
        print(f"[llamacpp] llama-quantize {f32.name} -> {dst.name} (once)", flush=True)
    llamacpp.quantize(f32, dst, KINDS[kind], threads=threads)
    return dst


# ---------------------------------------------------------------------------- server

class LlamaServer(PeerProcess):
    """One llama-server on loopback; use as a context manager."""

    name = "llama-server"

    def __init__(self, gguf: Path, port: int, workdir: Path, slots: int, ctx: int, threads: int = 2,
                 extra_args: list[str] | None = None) -> None:
        super().__init__(port, workdir, "llama-server.log")
        self.command = [
            str(llamacpp.program("llama-server")), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
            "-np", str(slots), "-c", str(slots * ctx), "--cont-batching", "--no-cache-prompt", "--cache-ram", "0",
            "--host", "127.0.0.1", "--port", str(port), *(extra_args or []),
        ]


# ---------------------------------------------------------------------------- clients

def request_body(prompt_ids: list[int], n_predict: int, stream: bool, fields: dict | None) -> dict:
    """Greedy unless `fields` say otherwise; llama.cpp's own top-k 40 and min-p 0.05 off, so sampling
    with a temperature draws from what the other servers draw from (temperature and top-p only)."""
    return {"prompt": prompt_ids, "n_predict": n_predict, "ignore_eos": True, "stream": stream,
            "cache_prompt": False, "return_tokens": True, "temperature": 0, "top_k": 0, "min_p": 0.0,
            **(fields or {})}


def llamacpp_stream(port: int, prompt_ids: list[int], n_predict: int, timeout: float = 600,
                    fields: dict | None = None) -> dict:
    """One streaming /completion request; times in seconds from sending, as clients.openai_stream's."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    started = time.perf_counter()
    try:
        body = json.dumps(request_body(prompt_ids, n_predict, True, fields)).encode()
        conn.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        first, final, ids = None, None, []
        for chunk in sse_chunks(response):
            if "error" in chunk:
                raise RuntimeError(f"llama-server: {chunk['error']}")
            if chunk.get("tokens"):
                first = first if first is not None else time.perf_counter() - started
                ids += chunk["tokens"]
            if chunk.get("stop"):
                final = chunk
                break
        latency = time.perf_counter() - started
        if final is None:
            raise RuntimeError("the stream ended without its final chunk")
        return {"ttft_s": first if first is not None else latency, "latency_s": latency,
                "tokens": final["tokens_predicted"], "prompt_tokens": final["tokens_evaluated"], "token_ids": ids}
    finally:
        conn.close()



def llamacpp_tokens(port: int, prompt_ids: list[int], n_predict: int, timeout: float = 600) -> dict:
    """Greedy token ids of one request that is not streamed: every one of them (a stream holds back
    tokens that end inside a UTF-8 character), and the prompt's length as the server counts it."""
    reply = post_json(port, "/completion", request_body(prompt_ids, n_predict, False, None), timeout)
    return {"token_ids": reply["tokens"], "prompt_tokens": reply["tokens_evaluated"]}


# ---------------------------------------------------------------------------- parity

def ours_greedy(ckpt: Path, text: str, tokens: int, dtype: str, timeout: float = 1800) -> dict:
    """Greedy tokens of the offline CLI on the checkpoint (one process, every core)."""
    out = run_module("tp_llama.generate", ["--ckpt-dir", str(ckpt), "--prompt", text, "--dtype", dtype,
                                           "--max-new-tokens", str(tokens), "--ignore-eos", "--temperature", "0"],
                     Path(__file__).resolve().parents[2], timeout)
    return last_json(out)


def parity(preset: str, prompt_len: int, tokens: int, kinds: list[str], threads: int) -> dict:
    from bench.lib.meta_gguf import gguf_module
    from tests.support.serving_util import free_ports
    from tp_llama.tokenizer import load_tokenizer

    gguf_module()  # missing gguf-py stops here, with the setup hint, before our model runs
    ckpt = ensure_checkpoint(PRESETS[preset], mp=1)
    text = prompt_text(ckpt, prompt_len)
    ids = load_tokenizer(ckpt / "tokenizer.model").encode(text, bos=True)
    ours = ours_greedy(ckpt, text, tokens, "float32")
    # A random-weight model can part at the first token between float32 and bfloat16 (in either
    # engine): llama.cpp's BF16 is held against our bfloat16 as well.
    ours_bf16 = ours_greedy(ckpt, text, tokens, "bfloat16")["token_ids"] if "bf16" in kinds else None
    result: dict = {"preset": preset, "ckpt": str(ckpt), "llamacpp": version(), "prompt_tokens": len(ids),
                    "ours_prompt_tokens": ours["usage"]["prompt_tokens"], "ours": ours["token_ids"],
                    "ours_bfloat16": ours_bf16, "kinds": {}}
    ctx = 256 * -(-(len(ids) + tokens + 1) // 256)
    for kind in kinds:
        gguf = gguf_for(ckpt, kind, threads)
        work = OUT / "llamacpp_parity" / kind
        with LlamaServer(gguf, free_ports(1)[0], work, 1, ctx, threads, EXACT) as server:
            server.start()
            server.wait_ready(600)
            got = llamacpp_tokens(server.port, ids, tokens)
            # The text through llama.cpp's tokenizer (BOS added by the vocabulary's rule), against our ids.
            tokenized = post_json(server.port, "/tokenize", {"content": text, "add_special": True}, 60)["tokens"]
        result["kinds"][kind] = {"gguf": str(gguf), "tokens": got["token_ids"], "prompt_tokens": got["prompt_tokens"],
                                 "identical_prefix": common_prefix(ours["token_ids"], got["token_ids"]),
                                 "same_tokenization": tokenized == ids}
        also = ""
        if kind == "bf16":
            n = result["kinds"][kind]["identical_prefix_bfloat16"] = common_prefix(ours_bf16, got["token_ids"])
            also = f", {n} to ours in bfloat16"
        print(f"[parity] {kind}: first {result['kinds'][kind]['identical_prefix']} of {tokens} greedy tokens "
              f"identical to ours in float32{also}; llama.cpp tokenizes the text "
              f"{'alike' if tokenized == ids else 'OTHERWISE'}", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gguf", help="make (once) and list a preset's GGUFs")
    g.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    g.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    p = sub.add_parser("parity", help="llama.cpp's greedy tokens against ours in float32 on the same checkpoint")
    p.add_argument("--preset", choices=sorted(PRESETS), default="quarter")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--kinds", nargs="+", choices=list(KINDS), default=["f32"],
                   help="GGUFs to run (f32 is the parity check; the others show how far each quantization drifts)")
    for s in (g, p):
        s.add_argument("--threads", type=int, default=2)
    a = parser.parse_args(argv)
    if a.command == "gguf":
        ckpt = ensure_checkpoint(PRESETS[a.preset], mp=1)
        for kind in a.kinds:
            path = gguf_for(ckpt, kind, a.threads)
            print(f"{kind}: {path} ({path.stat().st_size / 1e9:.2f} GB)")
    else:
        result = parity(a.preset, a.prompt_len, a.tokens, a.kinds, a.threads)
        path = OUT / f"llamacpp_parity_{a.preset}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: v["identical_prefix"] for k, v in result["kinds"].items()}), f"raw: {path}")
        if result["kinds"].get("f32", {}).get("identical_prefix", a.tokens) < min(8, a.tokens):
            sys.exit(1)


if __name__ == "__main__":
    main()
