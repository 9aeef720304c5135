"""Turn bench/out/*.json into the plot and the results section of BENCHMARKS.md.

    python -m bench.report

Only the text between the two markers in BENCHMARKS.md is replaced, so the written analysis
around it stays as it is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.engine import generate, load
from bench.serving import versus_cli
from bench.lib.common import BENCH, OUT, REPO, table

DOC = REPO / "BENCHMARKS.md"
PLOT = BENCH / "benchmarks.png"
START, END = "<!-- results:start -->", "<!-- results:end -->"
COMMAND = "bench/run_all.sh"
METHOD_COLORS = {"floor": "#888888", "direct": "#1f77b4", "seed": "#d62728", "merge": "#ff7f0e"}


def load_results() -> dict[str, dict]:
    return {name: json.loads((OUT / f"{name}.json").read_text()) for name in ("load", "generate", "serve")}


def plot(results: dict[str, dict], path: Path = PLOT) -> None:
    """Left: serving tokens/s against concurrency. Right: load seconds per method against the floor."""
    import matplotlib  # a bench-only package (bench/requirements.txt): --help works without it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (serve_ax, load_ax) = plt.subplots(1, 2, figsize=(12, 4.5))

    levels = [lv for lv in results["serve"]["levels"] if lv["stream"]]
    clients = [lv["clients"] for lv in levels]
    tokens = [lv["tokens_per_s"] for lv in levels]
    serve_ax.plot(clients, tokens, "o-", label="TorchServe, streaming")
    serve_ax.plot(clients, [tokens[0] * c for c in clients], ":", color="gray", label="linear in clients")
    serve_ax.plot([clients[-1]], [4 * tokens[0]], "_", color="green", markersize=30, markeredgewidth=3,
                  label=f"target at {clients[-1]}: 4x one client")
    serve_ax.set_xscale("log", base=2)
    serve_ax.set_xticks(clients, [str(c) for c in clients])
    serve_ax.set_ylim(0, max(max(tokens), 4 * tokens[0]) * 1.4)
    serve_ax.set_xlabel("concurrent clients")
    serve_ax.set_ylabel("generated tokens/s (all clients)")
    serve_ax.set_title(f"Serving, TP {results['serve']['tp']} ({results['serve']['preset']} preset)")
    serve_ax.legend(loc="upper left")

    pairs = results["load"]["results"]
    width = 0.2
    # The seed path is ~10x slower; clip it so floor and direct stay readable, and print its value.
    top = 1.4 * max(s["wall_s"] for r in pairs for m, s in r["methods"].items() if m != "seed" and "wall_s" in s)
    for i, res in enumerate(pairs):
        floor = res["methods"]["floor"]["wall_s"]
        for j, method in enumerate(METHOD_COLORS):
            s = res["methods"].get(method, {})
            x = i + (j - 1.5) * width
            if "wall_s" not in s:
                load_ax.text(x, 0.05 * top, "failed" if s else "n/a", rotation=90, ha="center", fontsize=8)
                continue
            load_ax.bar(x, min(s["wall_s"], top), width, color=METHOD_COLORS[method])
            if s["wall_s"] > top:
                load_ax.text(x, 0.97 * top, f"{s['wall_s']:.0f} s", rotation=90, ha="center", va="top", fontsize=8,
                             color="white")
        load_ax.hlines(1.5 * floor, i - 2 * width, i + 2 * width, colors="black", linestyles="--")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in METHOD_COLORS.values()]
    handles.append(plt.Line2D([], [], color="black", ls="--"))
    load_ax.legend(handles, [*METHOD_COLORS, "target: 1.5x floor"], loc="upper center", ncol=3, fontsize=8)
    load_ax.set_ylim(0, 1.3 * top)  # room for the legend above the bars
    load_ax.set_xticks(range(len(pairs)), [f"MP {r['mp']} -> TP {r['tp']}" for r in pairs])
    load_ax.set_ylabel("seconds to load (slowest rank, cold cache)")
    load_ax.set_title(f"Loading {results['load']['preset']} ({results['load']['dtype'].split('.')[-1]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def results_section(results: dict[str, dict]) -> str:
    m = results["load"]["machine"]
    loads = "; ".join(f"{name} {r['machine']['load_avg']}" for name, r in results.items())
    rows = []
    for module, name in ((load, "load"), (generate, "generate"), (versus_cli, "serve")):
        rows += [[target, measured, "met" if met else "**missed**"] for target, measured, met in module.targets(
            results[name])]
    return "\n".join([
        START,
        f"Command: `{COMMAND}`. Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, no GPU; "
        f"Python {m['python']}, torch {m['torch']}. Load averages (1/5/15 min) when each part finished, "
        f"from other users of the machine: {loads}.",
        "",
        "### Targets",
        "",
        table(["target", "measured", ""], rows),
        "",
        f"![tokens/s against concurrency, and load seconds against the floor]({PLOT.relative_to(REPO)})",
        "",
        "### 1. Loading",
        "",
        load.report(results["load"]),
        "",
        "### 2. Generation",
        "",
        generate.report(results["generate"]),
        "",
        "### 3. Serving",
        "",
        versus_cli.report(results["serve"]),
        END,
    ])


def update_doc(results: dict[str, dict], doc: Path = DOC) -> None:
    text = doc.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{doc} needs the markers {START} and {END}")
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    doc.write_text(head + results_section(results) + tail)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    results = load_results()
    plot(results)
    update_doc(results)
    print(f"wrote {PLOT} and the results section of {DOC}")


if __name__ == "__main__":
    main()
