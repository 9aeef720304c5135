"""Comments and docstrings in the product give reasons, not lab notes: a timing, a rate or a speed-up
measured on one machine goes stale in the code and belongs in BENCHMARKS.md, with the comment naming
the benchmark that shows it (e.g. "4 rows a pass: widening costs more than spilling
(bench/kernels/matmul.py)")."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from bisect import bisect_right
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NUM = r"~?\d+(?:\.\d+)?(?:\s*(?:-|–|to)\s*\d+(?:\.\d+)?)?"  # 8.3, ~0.2, 0.71-0.85, 34.6 to 30.5
MEASUREMENT = re.compile("|".join([
    rf"(?<![\w.]){NUM}\s*(?:ms|us|µs|ns|[GM]i?B/s|[GT]FLOP/?S|tok/s|tokens/s)(?!\w)",  # "8.3 ms", "25 GB/s"
    rf"\b(?:took|spent|lasted|ran in|loads in|loaded in)\s+{NUM}\s*(?:s|seconds|min|minutes)\b",  # "took 50 s"
    r"(?<![\w.])~?(?:\d*\.\d+|\d+(?:\.\d+)?\s*[-–]\s*\d+(?:\.\d+)?)x\b",  # "0.85x", "1.9-2.1x"
    r"(?<![\w.])~?\d+x\s+(?:faster|slower|shorter|longer|the time|\w+'s time)",  # "8x faster"
    rf"(?<![\w.]){NUM}\s*%\s*(?:faster|slower|shorter|longer|more|less|of\b)",  # "15% faster", "1% of a step"
    rf"\b(?:by|cost|costs)\s+{NUM}\s*%",  # "beat 3 by 16%"
]), re.IGNORECASE)
# A C comment, after the string and character literals that could hold its opening characters.
C_TOKEN = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|/\*.*?\*/|//[^\n]*', re.S)


def python_comments(source: str) -> list[tuple[int, list[str]]]:
    """(first line, lines) of each run of # comments on adjacent lines and of each docstring."""
    blocks: list[tuple[int, list[str]]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        if blocks and blocks[-1][0] + len(blocks[-1][1]) == tok.start[0]:
            blocks[-1][1].append(tok.string)
        else:
            blocks.append((tok.start[0], [tok.string]))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                blocks.append((first.lineno, first.value.value.splitlines()))
    return blocks


def c_comments(source: str) -> list[tuple[int, list[str]]]:
    return [(source.count("\n", 0, m.start()) + 1, m.group().splitlines())
            for m in C_TOKEN.finditer(source) if m.group().startswith("/")]


def lab_notes(source: str, suffix: str) -> list[tuple[int, str, str]]:
    """(line, comment line, measurement) of each measurement quoted in the source's comments. A
    comment's lines are joined first, so a measurement broken over two lines is still found."""
    found = []
    for first, lines in (python_comments if suffix == ".py" else c_comments)(source):
        starts, text = [], ""
        for line in lines:
            starts.append(len(text))
            text += line.strip().lstrip("/*#").strip() + " "
        for hit in MEASUREMENT.finditer(text):
            index = bisect_right(starts, hit.start()) - 1
            found.append((first + index, lines[index].strip(), hit.group()))
    return found


def product_files() -> list[Path]:
    return sorted(p for pattern in ("*.py", "*.c", "*.h") for top in ("tp_llama", "handler")
                  for p in (REPO / top).rglob(pattern))


def test_comments_quote_no_measurements():
    notes = [f"{path.relative_to(REPO)}:{line}: {measurement!r} in: {text}"
             for path in product_files() for line, text, measurement in lab_notes(path.read_text(), path.suffix)]
    assert not notes, ("comments quote measurements; give the reason and name the benchmark, and move the "
                       "numbers to BENCHMARKS.md:\n" + "\n".join(notes))


LAB_NOTES = [
    (".py", "# 4 rows a pass: 4 rows beat 3 by 16% at 8 rows\nROWS = 4\n"),
    (".py", 'def f():\n    """Eager, it took 8.3 ms a step."""\n'),
    (".py", "x = 1  # streamed at\n# 25 GB/s on this VM\n"),
    (".py", "\"\"\"Tiles: 2.2x faster than widening, 0.71-0.85x oneDNN's time.\"\"\"\n"),
    (".py", "class A:\n    '''The collector was 1% of a decode step.'''\n"),
    (".py", "# the 1B shape loads in ~5.5 s\n"),
    (".c", "/* prefetches ahead:\n * 15-25% faster at 8 rows */\nint x;\n"),
    (".c", "int x; // took 50 s to load\n"),
    (".c", "/* 270-370 GFLOPS on an AMX Xeon */\n"),
]
REASONS = [
    (".py", "# 4 rows a pass: widening costs more than spilling (bench/kernels/matmul.py)\nROWS = 4\n"),
    (".py", '"""2 MiB pages, 32 bits, int64, Llama 3.1 8B, top_p 0.9, 2,048 positions."""\nTIMEOUT_S = 300\n'),
    (".py", 'def f():\n    """A 300 s timeout; the GB/s column of bench/kernels/matmul.py; 0x1f; 2x2 tiles."""\n'),
    (".c", '#define ROWS 8 /* 8 rows x 2 key blocks: 16 of 32 registers */\nconst char *s = "/* 8.3 ms */";\n'),
]


@pytest.mark.parametrize("suffix, source", LAB_NOTES)
def test_the_checker_catches_a_lab_note(suffix, source):
    assert lab_notes(source, suffix)


@pytest.mark.parametrize("suffix, source", REASONS)
def test_the_checker_passes_a_reason(suffix, source):
    assert not lab_notes(source, suffix)


def test_the_checker_reports_the_line_of_the_measurement():
    assert [line for line, _, _ in lab_notes("x = 1\n\n# a pass over\n# the weights took 8.3 ms\n", ".py")] == [4]
    assert [line for line, _, _ in lab_notes("int x;\n/* a pass\n * took 8.3 ms */\n", ".c")] == [3]
    assert lab_notes('def f():\n    """Eager:\n\n    8.3 ms."""\n', ".py")[0][:2] == (4, "8.3 ms.")
