"""The tables and plot of `--scenario levels` (bench/serving/levels.py), from its JSON.

Per server: output tok/s, TTFT and latency percentiles, TPOT; then the ratio of each pair that ran
(ours / vLLM, ours / before, ours / llama.cpp at the same number of bits: ours-int8 / llamacpp-q8_0,
ours-int4 / llamacpp-q4_0 and / llamacpp-q4_k_m, ours / llamacpp-bf16 or -f32), per round too with
--rounds; the latency scenarios; and notes: the setup, the CPU's flags, prompt lengths, how many
greedy tokens the servers agree on, errors.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.lib.common import table
from bench.lib.generation import common_prefix
from bench.serving.clients import SAMPLING

LLAMACPP_KINDS = ("f32", "bf16", "q8_0", "q4_0", "q4_k_m")
# Every server levels.py runs, in the order the tables list them.
SERVERS = ("ours", "ours-int8", "ours-int4", "before", "vllm", *(f"llamacpp-{k}" for k in LLAMACPP_KINDS))
# (a, b): a table of a / b where both ran; the same weights at about the same bits per weight.
PAIRS = (("ours", "vllm"), ("ours", "before"), ("ours", "llamacpp-bf16"), ("ours", "llamacpp-f32"),
         ("ours-int8", "llamacpp-q8_0"), ("ours-int4", "llamacpp-q4_0"), ("ours-int4", "llamacpp-q4_k_m"))


def ours_like(name: str) -> bool:
    """A TorchServe of ours (this checkout at any quantization, or before): the latency scenarios run on it."""
    return name.startswith("ours") or name == "before"


def level_at(res: dict, clients: int) -> dict | None:
    return next((x for x in res["levels"] if x["clients"] == clients), None)


def agreement_pairs(servers: dict[str, dict]) -> list[tuple[str, str]]:
    """Whose greedy tokens are held against whose: ours and before against vLLM (as before), the
    quantized servers and llama.cpp's against ours, and each pair of the same bits."""
    out = [(n, "vllm") for n in servers if ours_like(n) and "vllm" in servers]
    out += [(n, "ours") for n in servers if n != "ours" and not n.startswith("before") and n != "vllm"
            and "ours" in servers]
    out += [p for p in PAIRS if p[0] != "ours" and p[0] in servers and p[1] in servers]
    return list(dict.fromkeys(out))


def report(data: dict) -> str:
    servers = {name: data["servers"][name] for name in SERVERS if "levels" in data["servers"].get(name, {})}
    parts = []
    headers = ["clients", "requests", "errors", "output tok/s", "TTFT p50 s", "TTFT p95 s", "latency p50 s",
               "latency p95 s", "TPOT p50 ms"]
    for name, res in servers.items():
        rows = [[lv["clients"], lv["requests"], lv["errors"], lv["tokens_per_s"], lv.get("ttft_p50_s", "-"),
                 lv.get("ttft_p95_s", "-"), lv.get("latency_p50_s", "-"), lv.get("latency_p95_s", "-"),
                 1000 * lv["tpot_p50_s"] if lv.get("tpot_p50_s") else "-"] for lv in res["levels"]]
        parts.append(f"### {name}\n\n" + table(headers, rows))
    pairs = [(a, b) for a, b in PAIRS if a in servers and b in servers]
    if pairs:
        rows = []
        for a_, b_ in pairs:
            for lv in servers[a_]["levels"]:
                other = level_at(servers[b_], lv["clients"])
                row = [f"{a_} / {b_}", lv["clients"]]
                for key in ("tokens_per_s", "ttft_p50_s", "latency_p50_s"):
                    ok = other and lv.get(key) and other.get(key)
                    row.append(lv[key] / other[key] if ok else "-")
                rows.append(row)
        parts.append("### ratios\n\n" + table(["pair", "clients", "tok/s", "TTFT p50", "latency p50"], rows))
        if data.get("rounds", 1) > 1:
            parts.append("### ratios per round (the two runs side by side in time)\n\n" + paired(servers, pairs))
    scen = [(name, res) for name, res in servers.items() if "short_behind_long" in res]
    if scen:
        rows = []
        for name, res in scen:
            s, d = res["short_behind_long"], res["disconnects"]
            if "error" in s:
                rows.append([name, "short behind long", "-", "-", s["error"]])
            else:
                rows.append([name, f"{s['short_tokens']} behind {s['long_tokens']}", s["alone"]["latency_s"],
                             s["behind_latency_s"], s["ratio"]])
            if "error" in d:
                rows.append([name, "disconnects", "-", "-", d["error"]])
            else:
                rows.append([name, f"{d['probe_tokens']} after {d['clients']} x {d['long_tokens']} disconnected",
                             d["alone"]["latency_s"], d["after_latency_s"], d["ratio"]])
        parts.append("### latency scenarios\n\n" + table(["server", "scenario", "alone s", "with others s",
                                                         "ratio"], rows))
    return "\n\n".join(parts) + "\n\n" + "\n".join(notes(data, servers))


def notes(data: dict, servers: dict[str, dict]) -> list[str]:
    sampling = data.get("sampling", "greedy")  # JSON of runs from before the option: greedy
    setup = (f"- {data['preset']} preset, {data['dtype']}, prompt {data['prompt_len']} token ids, "
             f"{data['new_tokens']} new tokens per request, sampling {sampling} ({SAMPLING[sampling]}), "
             f"stop tokens ignored; {data['requests']} request(s) per client back to back; our servers TP "
             f"{data['tp']} x {data['omp_threads']} OpenMP thread(s); vLLM cores {data['vllm_cores']}")
    if any(n.startswith("llamacpp") for n in servers) and "llamacpp" in data:
        lc = data["llamacpp"]
        setup += (f"; llama.cpp {lc['version']}, {lc['threads']} thread(s), {lc['slots']} slot(s) of "
                  f"{lc['ctx']} positions, GGUFs by its llama-quantize from an F32 GGUF of the same checkpoint")
    out = [setup + "."]
    if data.get("cpu_flags") is not None:
        cpu = data.get("machine", {}).get("cpu")
        out.append(f"- CPU flags: {' '.join(data['cpu_flags']) or 'none of the listed'}" + (f" ({cpu})" if cpu else "")
                   + ".")
    for name, res in servers.items():
        if res.get("prompt_tokens") != data["prompt_len"]:
            out.append(f"- {name}: prompt counted as {res.get('prompt_tokens')} tokens, not {data['prompt_len']}.")
    for a_, b_ in agreement_pairs(servers):
        n = common_prefix(servers[a_].get("first_tokens", []), servers[b_].get("first_tokens", []))
        out.append(f"- {a_} vs {b_}: first {n} of {data['check_tokens']} greedy tokens identical"
                   + ("" if servers[b_].get("first_tokens") else f" ({b_} sent no token ids)") + ".")
    for name, res in servers.items():
        for lv in res["levels"]:
            if lv["errors"]:
                out.append(f"- {name}, {lv['clients']} clients: {lv['errors']} error(s), e.g. {lv['error_samples'][0]}")
            if lv.get("short_replies"):
                out.append(f"- {name}, {lv['clients']} clients: {lv['short_replies']} reply(ies) not "
                           f"{data['new_tokens']} tokens long.")
    for name, err in data.get("failed", {}).items():
        out.append(f"- {name}: not measured: {err}")
    return out


def paired(servers: dict[str, dict], pairs: list[tuple[str, str]]) -> str:
    """Per level and pair: the median and range of each round's ratio, and the waiting servers' CPU seconds."""
    rows = []
    for a_, b_ in pairs:
        for lv in servers[a_]["levels"]:
            other = level_at(servers[b_], lv["clients"])
            if other is None or "rounds" not in lv or "rounds" not in other:
                continue
            row = [f"{a_} / {b_}", lv["clients"]]
            for key in ("tokens_per_s", "ttft_p50_s"):
                ratios = [x[key] / y[key] for x, y in zip(lv["rounds"], other["rounds"]) if x.get(key) and y.get(key)]
                row += [statistics.median(ratios), f"{min(ratios):.2f}-{max(ratios):.2f}"] if ratios else ["-", "-"]
            idle = [r["idle_cpu_s"] for r in lv["rounds"] + other["rounds"]]
            rows.append([*row, len(lv["rounds"]), max(idle)])
    return table(["pair", "clients", "tok/s ratio, median", "range", "TTFT p50 ratio, median", "range", "rounds",
                  "waiting servers' CPU s, most"], rows)


def plot(data: dict, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib missing (.venv/bin/python -m pip install -r bench/requirements.txt)")
        return None
    fig, (tok_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in SERVERS:
        res = data["servers"].get(name, {})
        lvs = [lv for lv in res.get("levels", []) if lv["requests"]]
        if not lvs:
            continue
        x = [lv["clients"] for lv in lvs]
        tok_ax.plot(x, [lv["tokens_per_s"] for lv in lvs], "o-", label=name)
        ttft_ax.plot(x, [lv["ttft_p50_s"] for lv in lvs], "o-", label=name)
    for ax, label in ((tok_ax, "output tokens/s (all clients)"), (ttft_ax, "TTFT p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["concurrency"], [str(c) for c in data["concurrency"]])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle(f"{data['preset']} preset, {data['dtype']}, prompt {data['prompt_len']}, "
                 f"{data['new_tokens']} new tokens, ours TP {data['tp']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
