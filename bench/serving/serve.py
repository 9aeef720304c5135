"""The serving benchmark: a real TorchServe on loopback (vLLM and llama.cpp beside it), one scenario a run.

    python -m bench.serving.serve [--scenario levels] [OPTIONS]   # concurrency levels: ours, before, vLLM, llama.cpp
    python -m bench.serving.serve --scenario prefix [OPTIONS]     # prefix caching and the paged KV cache
    python -m bench.serving.serve --scenario cli [OPTIONS]        # ours against the offline CLI (the first suite)
    python -m bench.serving.serve --scenario lora [OPTIONS]       # LoRA adapters against the base, ours and vLLM
    python -m bench.serving.serve --scenario SCENARIO --help      # that scenario's options, what it measures

Each scenario keeps its options, defaults, tables and raw JSON (bench/out/bench_cb.json,
bench_prefix.json, serve.json, lora.json): the first three were bench.bench_cb, bench.bench_prefix and
bench.bench_serve.
"""

from __future__ import annotations

import argparse

from bench.serving import levels, lora, prefix, versus_cli

SCENARIOS = {"levels": levels, "prefix": prefix, "cli": versus_cli, "lora": lora}


def main(argv: list[str] | None = None) -> None:
    pick = argparse.ArgumentParser(prog="python -m bench.serving.serve", add_help=False, allow_abbrev=False)
    pick.add_argument("--scenario", choices=SCENARIOS, default="levels")
    scenario = SCENARIOS[pick.parse_known_args(argv)[0].scenario]
    parser = argparse.ArgumentParser(prog="python -m bench.serving.serve", description=__doc__ + "\n" + scenario.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=SCENARIOS, default="levels",
                        help="what to measure (default levels); each has its own options and defaults, below")
    scenario.options(parser)
    a = parser.parse_args(argv)
    del a.scenario  # the scenario's JSON records its own options only, as before
    scenario.run(a, parser)


if __name__ == "__main__":
    main()
