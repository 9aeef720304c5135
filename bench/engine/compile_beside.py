"""What compiling grammars costs the sequences already running (issue 47: their steps at most 10% slower).

    python -m bench.engine.compile_beside [--preset llama3.2-1b] [--dtype bfloat16] [--batch 4]
                                          [--window 8] [--windows 6] [--rounds 3]

One process, TP 1, the offline engine on the preset's checkpoint (Meta's real tokenizer): --batch
sequences decode for the whole run while, window by window of --window decode steps, either nothing
compiles ("quiet") or the serving GrammarCompiler compiles large grammars back to back on its worker
threads ("compiling": a JSON schema of a 100,000-value enum, a deeply nested one, a regex of wide
bounds, each made unique so its cache never answers). The two kinds of window alternate, so both see
the same machine. Prints, per round, the median decode-step time of each kind and their ratio, with
the CPU's flags and the compiles finished during the compiling windows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time

from bench.lib.checkpoint import PRESETS, ensure_checkpoint
from bench.lib.generation import prompts
from bench.lib.llamacpp import cpu_flags
from tp_llama.config import EngineConfig
from tp_llama.engine.constraint import grammar_tokenizer
from tp_llama.engine.core import Engine
from tp_llama.engine.sampling import SamplingParams
from tp_llama.engine.scheduler import Sequence
from tp_llama.serving.grammars import GrammarCompiler
from tp_llama.serving.request import GrammarSpec


def large_grammars():
    """An endless supply of distinct grammars that take llguidance long to compile."""
    for n in itertools.count():
        deep: dict = {"type": "integer", "minimum": n}
        for _ in range(40):
            deep = {"type": "object", "properties": {"a": deep, "b": {"enum": [f"x{n}", "y"]}}, "required": ["a"]}
        yield GrammarSpec("json", json.dumps({"enum": [f"value-{n}-{i}" for i in range(100_000)]}), "bench")
        yield GrammarSpec("json", json.dumps(deep), "bench")
        yield GrammarSpec("regex", f"({n}[a-z]{{1,400}}-[0-9]{{1,400}}){{1,20}}", "bench")


class Compiling:
    """Keeps the compiler's workers busy with fresh grammars while `on` is set."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler, self.on, self.done = compiler, threading.Event(), 0
        self.supply = large_grammars()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.on.wait()
            pending = [self.compiler.submit(next(self.supply)) for _ in range(2)]
            for p in pending:
                try:
                    p.future.result()
                except Exception:  # a refusal is a compile too
                    pass
                self.done += 1


def run_round(engine: Engine, compiling: Compiling, a: argparse.Namespace) -> dict[str, float]:
    """Median ms per decode step in quiet and in compiling windows, alternating."""
    times: dict[str, list[float]] = {"quiet": [], "compiling": []}
    state = {"last": 0.0, "step": 0}

    def on_step(_) -> None:
        now = time.perf_counter()
        step, kind = state["step"], ("quiet", "compiling")[(state["step"] // a.window) % 2]
        if state["last"] and step % a.window:  # the first step of a window runs while the switch settles
            times[kind].append(now - state["last"])
        state["last"], state["step"] = now, step + 1
        next_kind = ("quiet", "compiling")[(state["step"] // a.window) % 2]
        (compiling.on.set if next_kind == "compiling" else compiling.on.clear)()

    steps = a.window * a.windows
    params = SamplingParams(steps + 1, ignore_eos=True)
    before = compiling.done
    engine.generate([Sequence(str(i), p, params) for i, p in enumerate(prompts(engine.args, a.batch, 64))],
                    on_step=on_step)
    compiling.on.clear()
    quiet, busy = (1e3 * statistics.median(times[k]) for k in ("quiet", "compiling"))
    return {"quiet_ms": quiet, "compiling_ms": busy, "ratio": busy / quiet, "compiles": compiling.done - before}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--window", type=int, default=8, help="decode steps per window")
    parser.add_argument("--windows", type=int, default=6, help="windows per round, quiet and compiling in turn")
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args(argv)
    engine = Engine.load(EngineConfig(str(ensure_checkpoint(PRESETS[a.preset], mp=1)), "tp", a.dtype,
                                      max_seq_len=512, max_batch_size=a.batch))
    compiling = Compiling(GrammarCompiler(grammar_tokenizer(engine.tokenizer)))
    rows = [run_round(engine, compiling, a) for _ in range(a.rounds)]
    print(f"\nCPU flags: {' '.join(cpu_flags())}; {a.preset}, {a.dtype}, {a.batch} sequences decoding, TP 1")
    print("| round | quiet ms/step | compiling ms/step | ratio | compiles finished |")
    print("|---|---|---|---|---|")
    for i, row in enumerate(rows, 1):
        print(f"| {i} | {row['quiet_ms']:.1f} | {row['compiling_ms']:.1f} | {row['ratio']:.3f}x | {row['compiles']} |")


if __name__ == "__main__":
    main()
