"""bench/serving/structured.py's tables from its JSON: each server's constrained and unconstrained
requests side by side, then ours / vLLM per round, with the CPU named above them."""

from __future__ import annotations

import statistics

from bench.lib.common import table


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.0f}"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x and y else None


def _spread(ratios: list[float | None]) -> str:
    known = [r for r in ratios if r is not None]
    if not known:
        return "-"
    if len(known) == 1:
        return f"{known[0]:.2f}x"
    return f"{statistics.median(known):.2f}x ({min(known):.2f}-{max(known):.2f})"


def header(data: dict) -> str:
    machine = data.get("machine", {})
    servers = ", ".join(f"{name} {info.get('dtype', '')}".strip() for name, info in data["servers"].items())
    return (f"CPU: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, flags "
            f"{' '.join(data.get('cpu_flags', []))}; load average {machine.get('load_avg')} when written.\n"
            f"{data['preset']} ({data['layers']} layers), {servers}; TP {data['tp']} x {data['omp_threads']} threads; "
            f"prompt {data['prompt_len']} ids; {data['sampling']} sampling; {data['requests']} request(s) per client "
            f"and kind; constrained max_tokens {data['max_tokens']}, unconstrained {data['new_tokens']} (ignore_eos); "
            f"{data['rounds']} round(s)"
            + "".join(f"\n{name}: vLLM {info.get('version')}, structured outputs {info['structured_outputs_config']}"
                      for name, info in data["servers"].items() if "structured_outputs_config" in info))


def server_rows(data: dict) -> list[list[object]]:
    rows = []
    for name, info in data["servers"].items():
        for level in info["levels"]:
            c, u = level["constrained"], level["unconstrained"]
            rows.append([
                name, level["clients"], f"{c['tokens_per_s']:.1f} / {u['tokens_per_s']:.1f}",
                f"{_s(c.get('ttft_p50_s'))} / {_s(u.get('ttft_p50_s'))}",
                f"{_ms(c.get('tpot_p50_s'))} / {_ms(u.get('tpot_p50_s'))}",
                _spread([_ratio(rc.get("tpot_p50_s"), ru.get("tpot_p50_s"))
                         for rc, ru in zip(c["rounds"], u["rounds"])]),
                _spread([_ratio(rc.get("step_p50_s"), ru.get("step_p50_s"))
                         for rc, ru in zip(c["rounds"], u["rounds"])]),
                f"{c.get('invalid', 0)} / {c.get('replies', c['requests'])}",
                f"{c['tokens_mean']:.1f}" if c.get("tokens_mean") is not None else "-",
                " ".join(f"{k} {v}" for k, v in sorted(c.get("finish_reasons", {}).items())),
                c["errors"] + u["errors"],
            ])
    return rows


def versus_rows(data: dict) -> list[list[object]]:
    ours = data["servers"].get("ours")
    rows = []
    for name, info in data["servers"].items():
        if not name.startswith("vllm") or ours is None:
            continue
        for mine, theirs in zip(ours["levels"], info["levels"]):
            c_ours, c_vllm = mine["constrained"], theirs["constrained"]
            per_round = [_ratio(x["tokens_per_s"], y["tokens_per_s"]) for x, y in zip(c_ours["rounds"], c_vllm["rounds"])]
            free = [_ratio(x["tokens_per_s"], y["tokens_per_s"])
                    for x, y in zip(mine["unconstrained"]["rounds"], theirs["unconstrained"]["rounds"])]
            rows.append([
                f"ours / {name}", mine["clients"],
                ", ".join(f"{x['tokens_per_s']:.1f} / {y['tokens_per_s']:.1f}"
                          for x, y in zip(c_ours["rounds"], c_vllm["rounds"])),
                _spread(per_round), _spread(free),
                f"{_ms(c_ours.get('tpot_p50_s'))} / {_ms(c_vllm.get('tpot_p50_s'))}",
                f"{_s(c_ours.get('ttft_p50_s'))} / {_s(c_vllm.get('ttft_p50_s'))}",
            ])
    return rows


def report(data: dict) -> str:
    parts = [header(data), "",
             table(["server", "clients", "tok/s constrained / free", "TTFT p50 s constrained / free",
                    "TPOT p50 ms constrained / free", "TPOT constrained / free, median (range)",
                    "ms per decode step constrained / free (the stop token's step counted)",
                    "invalid / constrained replies", "tokens per constrained reply", "finish reasons (constrained)",
                    "errors"], server_rows(data))]
    versus = versus_rows(data)
    if versus:
        parts += ["", table(["servers", "clients", "constrained tok/s per round", "constrained tok/s ratio, median "
                             "(range)", "free tok/s ratio", "TPOT p50 ms constrained", "TTFT p50 s constrained"],
                            versus)]
    for name, info in data["servers"].items():
        samples = [s for level in info["levels"] for s in level["constrained"].get("invalid_samples", [])]
        if samples or info.get("warm_invalid"):
            parts.append(f"\n{name}: invalid replies, e.g. " + " | ".join((samples or info["warm_invalid"])[:3]))
    for name, why in data.get("failed", {}).items():
        parts.append(f"\n{name} FAILED: {why[-600:]}")
    parts.append(f"\nCPU flags: {' '.join(data.get('cpu_flags', []))}")
    return "\n".join(parts)
