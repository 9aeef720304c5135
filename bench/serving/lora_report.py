"""bench/serving/lora.py's tables from its JSON: per server, requests on adapters against requests on the
base (TPOT, against issue 60's targets), then ours / vLLM on adapter requests, with the CPU named above."""

from __future__ import annotations

import statistics

from bench.lib.common import table
from bench.lib.generation import common_prefix
from bench.serving.levels_report import agreement_pairs

# Issue 60: TPOT of rows on adapters / on the base alone, at 1 row and at 8 rows on 8 different adapters (ours).
TPOT_TARGETS = {1: 1.15, 8: 1.3}
VERSUS_TARGET = 1.2  # ours / vLLM output tok/s on adapter requests, at least


def _spread(ratios: list[float]) -> tuple[float, str]:
    """The median of per-round ratios, and it written with its range."""
    if not ratios:
        return float("nan"), "-"
    mid = statistics.median(ratios)
    return mid, f"{mid:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else f"{mid:.2f}x"


def _per_round(x: dict, y: dict, key: str) -> list[float]:
    return [p[key] / q[key] for p, q in zip(x["rounds"], y["rounds"]) if p.get(key) and q.get(key)]


def _ms(level: dict) -> str:
    return f"{1e3 * level['tpot_p50_s']:.0f}" if level.get("tpot_p50_s") else "-"


def _errors(level: dict) -> tuple[int, list[str]]:
    """The errors of every round (the level's own count is their median), and a few of them."""
    return sum(r["errors"] for r in level["rounds"]), [e for r in level["rounds"] for e in r["error_samples"]]


def _verdict(value: float, target: float | None, at_most: bool) -> str:
    if target is None:
        return "-"
    met = value <= target if at_most else value >= target
    return f"{'<=' if at_most else '>='} {target}x: {'met' if met else 'MISSED'}"


def header(data: dict) -> str:
    machine = data.get("machine", {})
    vllm = data["servers"].get("vllm")
    peer = (f"vLLM {vllm.get('version')} {data['vllm_dtype']}, cores {data['vllm_cores']}, --enable-lora --max-loras "
            f"{len(data['adapters'])} --max-lora-rank {data['rank']}" if vllm else "no vLLM")
    return (f"CPU: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, flags {' '.join(data['cpu_flags'])}; "
            f"load average {machine.get('load_avg')} when written.\n"
            f"{data['preset']} preset, random weights; {len(data['adapters'])} random PEFT adapters of rank "
            f"{data['rank']} on {', '.join(data['modules'])}; ours {data['dtype']} (ours-int4: handler.quantize int4) "
            f"TP {data['tp']} x {data['omp_threads']} threads, prefix caching off; {peer}. Prompt {data['prompt_len']} "
            f"ids, {data['new_tokens']} new tokens, "
            f"greedy, {data['requests']} request(s) per client and kind; {data['rounds']} round(s), the servers and "
            "kinds taking turns; on adapters, each client names its own (C clients, C different adapters).")


def tpot_rows(data: dict) -> list[list[object]]:
    rows = []
    for name, info in data["servers"].items():
        for level in info["levels"]:
            base, lora = level["base"], level["adapters"]
            mid, text = _spread(_per_round(lora, base, "tpot_p50_s"))
            target = TPOT_TARGETS.get(level["clients"]) if name.startswith("ours") else None
            rows.append([name, level["clients"], f"{_ms(base)} / {_ms(lora)}", text, _verdict(mid, target, True),
                         f"{base['tokens_per_s']:.1f} / {lora['tokens_per_s']:.1f}",
                         f"{base.get('ttft_p50_s', float('nan')):.2f} / {lora.get('ttft_p50_s', float('nan')):.2f}",
                         _errors(base)[0] + _errors(lora)[0]])
    return rows


def versus_rows(data: dict) -> list[list[object]]:
    vllm = data["servers"].get("vllm")
    rows = []
    for name, info in data["servers"].items():
        if vllm is None or not name.startswith("ours"):
            continue
        for mine, theirs in zip(info["levels"], vllm["levels"]):
            lora, their_lora = mine["adapters"], theirs["adapters"]
            mid, text = _spread(_per_round(lora, their_lora, "tokens_per_s"))
            rows.append([f"{name} / vllm", mine["clients"],
                         ", ".join(f"{x['tokens_per_s']:.1f} / {y['tokens_per_s']:.1f}"
                                   for x, y in zip(lora["rounds"], their_lora["rounds"])),
                         text, _verdict(mid, VERSUS_TARGET if name == "ours" else None, False),
                         _spread(_per_round(mine["base"], theirs["base"], "tokens_per_s"))[1],
                         f"{_ms(lora)} / {_ms(their_lora)}"])
    return rows


def agreement(data: dict) -> list[str]:
    """How far the servers' greedy tokens agree on each adapter, and whether each adapter changed the base's."""
    servers, out = data["servers"], []
    for name, info in servers.items():
        changed = sum(t != info["first_tokens"] for t in info["adapter_tokens"].values())
        out.append(f"- {name}: {changed} of {len(info['adapter_tokens'])} adapters' greedy tokens differ from the "
                   "base's.")
    for x, y in agreement_pairs(servers):
        firsts = [common_prefix(servers[x]["adapter_tokens"][n], servers[y]["adapter_tokens"].get(n, []))
                  for n in servers[x]["adapter_tokens"]]
        base = common_prefix(servers[x]["first_tokens"], servers[y]["first_tokens"])
        out.append(f"- {x} vs {y}: the first {base} of {data['check_tokens']} greedy tokens identical on the base, "
                   f"{' / '.join(map(str, firsts))} on the adapters.")
    return out


def report(data: dict) -> str:
    parts = [header(data), "",
             table(["server", "clients", "TPOT p50 ms base / adapters", "TPOT adapters / base, median (range)",
                    "issue 60's target", "tok/s base / adapters", "TTFT p50 s base / adapters", "errors"],
                   tpot_rows(data))]
    versus = versus_rows(data)
    if versus:
        parts += ["", table(["servers", "clients", "adapter tok/s per round", "adapter tok/s ratio, median (range)",
                             "issue 60's target", "base tok/s ratio", "TPOT p50 ms on adapters"], versus)]
    parts += ["", *agreement(data)]
    for name, info in data["servers"].items():
        for level in info["levels"]:
            for kind in ("base", "adapters"):
                count, samples = _errors(level[kind])
                if count:
                    parts.append(f"- {name}, {level['clients']} clients, {kind}: {count} error(s), e.g. {samples[0]}")
    parts += [f"- {name}: not measured: {why[-1500:]}" for name, why in data.get("failed", {}).items()]
    parts.append(f"\nCPU flags: {' '.join(data['cpu_flags'])}")
    return "\n".join(parts)
