"""Every benchmark in turn, then the plot and BENCHMARKS.md: `python -m bench.run_all`.

Each part prints its table and writes bench/out/NAME.json; the checkpoints are written into
bench/out/ckpt the first time and reused after.
"""

from __future__ import annotations

import time

from bench import bench_generate, bench_load, bench_serve, report


def main() -> None:
    for name, part in (("load", bench_load), ("generate", bench_generate), ("serve", bench_serve)):
        started = time.perf_counter()
        print(f"\n==> {name}", flush=True)
        part.main([])
        print(f"==> {name} took {time.perf_counter() - started:.0f} s", flush=True)
    report.main()


if __name__ == "__main__":
    main()
