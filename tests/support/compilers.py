"""A C compiler that builds unoptimised, for the tests whose point is not the optimised code.

gcc takes the last -O it is given, so a wrapper that appends -O0 turns build.py's -O3 build into an
-O0 one in a fraction of the time, with the same files, symbols and struct layouts. The tests that
look at optimised code (the prefetches surviving -O3) and the kernels' own tests (the cached -O3
build) do not use it.
"""

from __future__ import annotations

from pathlib import Path


def unoptimised_compiler(folder: Path, compiler: str, log: Path | None = None) -> str:
    """A script in `folder` that runs `compiler` with -O0 after the caller's flags; with `log`, each
    compile first appends its process id there (a line a compile; `--version` is none)."""
    wrapper = folder / "cc-O0"
    record = f'[ "$1" = --version ] || echo $$ >> {log}\n' if log is not None else ""
    wrapper.write_text(f"#!/bin/sh\n{record}exec {compiler} \"$@\" -O0\n")
    wrapper.chmod(0o755)
    return str(wrapper)
