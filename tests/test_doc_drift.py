"""The lists the docs repeat from the code stay equal to the code's.

- The C kernels' builds named in README.md, docs/configuration.md and docs/cpu-kernels.md are
  tp_llama/kernels/cpu/build.py's VARIANTS, in its order.
- The defaults of the handler keys in docs/configuration.md's and README.md's tables, and the values
  of the shipped model-config.yaml, are the settings dataclasses' defaults; configuration.md's table of
  TorchServe's keys gives the shipped yaml's values.
- Every TP_LLAMA_* variable the code reads is named in docs/configuration.md, every one named there is
  read somewhere, and each of its table's variables treats an empty value as unset and refuses a bad
  one with a message naming it, as that page says.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from tp_llama.config import EngineConfig
from tp_llama.kernels.cpu.build import VARIANTS
from tp_llama.serving.settings import TORCHSERVE_KEYS, HandlerSettings

REPO = Path(__file__).resolve().parents[1]
CONFIGURATION = REPO / "docs" / "configuration.md"
SHIPPED = yaml.safe_load((REPO / "model-config.yaml").read_text())
VARIABLE = re.compile(r"\bTP_LLAMA_[A-Z0-9_]+\b")


def table_rows(path: Path) -> dict[str, list[str]]:
    """The markdown table rows of a page by their first cell, each as its cells (backticks kept)."""
    rows = {}
    lines = path.read_text().splitlines()
    for line, after in zip(lines, [*lines[1:], ""]):
        if line.startswith("|") and not line.startswith("|---") and not after.startswith("|---"):  # not a header
            cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
            rows.setdefault(cells[0], cells)
    return rows


def variants_in(text: str) -> list[str]:
    return re.findall(r"avx[a-z0-9-]*", text)


@pytest.mark.parametrize("page, where", [
    ("README.md", r"the best variant the CPU runs \(([^)]*)\)"),
    ("docs/configuration.md", r"\| `TP_LLAMA_KERNELS` \|[^|]*\|([^(|]*)"),
    ("docs/cpu-kernels.md", r"`TP_LLAMA_KERNELS=([^`]*)`"),
    ("docs/cpu-kernels.md", r"builds \((`avx[^;)]*)"),
])
def test_the_kernel_builds_the_docs_name_are_build_pys(page: str, where: str) -> None:
    found = re.search(where, (REPO / page).read_text(), re.S)
    assert found, f"{page}: the list of C kernel builds ({where}) is gone; update this test with the page"
    assert variants_in(found.group(1)) == list(VARIANTS), f"{page} lists {variants_in(found.group(1))}"


def setting_defaults() -> dict[str, object]:
    """Every handler key with its default (ckpt_dir has none; device is TorchServe's deviceType)."""
    defaults = {}
    for cls in (EngineConfig, HandlerSettings):
        for field in dataclasses.fields(cls):
            if field.name not in ("ckpt_dir", "device", "engine"):
                defaults[field.name] = field.default
    return defaults


def as_written(cell: str) -> str:
    """A documented default as a comparable word: its first word, without backticks, quotes or units."""
    word = cell.replace("`", "").split()[0].strip('"')
    return word


def same(value: object, written: str) -> bool:
    if value is None:
        return written in ("null", "unset")
    if isinstance(value, bool):
        return written == str(value).lower()
    if isinstance(value, (int, float)):
        try:
            return float(written) == float(value)
        except ValueError:
            return False
    return written.strip("'\"") == str(value)  # yaml quotes strings it would read otherwise ('off')


def test_the_handler_tables_give_the_codes_defaults() -> None:
    defaults = setting_defaults()
    wrong = []
    configuration = table_rows(CONFIGURATION)
    readme = table_rows(REPO / "README.md")
    for key, value in defaults.items():
        row = configuration.get(f"`{key}`")
        if row is None:
            wrong.append(f"docs/configuration.md: no row for `{key}`")
        elif not same(value, as_written(row[1])):
            wrong.append(f"docs/configuration.md: `{key}` default {row[1]!r}, the code's is {value!r}")
        row = readme.get(f"`handler.{key}`")
        if row is not None and not same(value, as_written(row[1])):
            wrong.append(f"README.md: `handler.{key}` default {row[1]!r}, the code's is {value!r}")
    assert not wrong, "\n".join(wrong)


def test_the_shipped_yaml_spells_out_the_defaults() -> None:
    defaults = setting_defaults()
    differ = {key: (value, defaults.get(key, "unknown")) for key, value in SHIPPED["handler"].items()
              if key != "ckpt_dir" and (key not in defaults or not same(defaults[key], yaml.safe_dump(value)[:-1]
                                                                           .removesuffix("\n...")))}
    assert not differ, f"model-config.yaml's handler values (yaml, code): {differ}"


def yaml_value(key: str) -> object:
    """The shipped yaml's value of a dotted key; None where it has none."""
    node: object = SHIPPED
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


@pytest.mark.parametrize("page", ["docs/configuration.md", "README.md"])
def test_the_torchserve_rows_give_the_shipped_yaml(page: str) -> None:
    wrong, checked = [], 0
    for first, row in table_rows(REPO / page).items():
        keys = re.findall(r"`([\w.-]+)`", first)
        if not keys or not all(k in TORCHSERVE_KEYS or k.startswith("torchrun.") for k in keys):
            continue
        cells = [c.strip() for c in row[1].split(" / ")] if len(keys) > 1 else [row[1]]
        for key, cell in zip(keys, cells, strict=True):
            value, written = yaml_value(key), as_written(cell)
            checked += 1
            if not (same(value, written) or (value is None and written in ("absent", "unset", "unset:"))):
                wrong.append(f"{page}: `{key}` documented as {cell!r}, model-config.yaml has {value!r}")
    assert checked >= 3 and not wrong, "\n".join(wrong)


def code_variables(paths: list[Path]) -> dict[str, list[str]]:
    """TP_LLAMA_* names in quotes in these files (the ones code reads or sets), with where."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for name in re.findall(r"[\"'](TP_LLAMA_[A-Z0-9_]+)[\"']", path.read_text()):
            found.setdefault(name, []).append(str(path.relative_to(REPO)))
    return found


PRODUCT = [*REPO.glob("tp_llama/**/*.py"), *REPO.glob("handler/*.py"), *REPO.glob("deploy/*.py")]
TESTS = [*REPO.glob("tests/**/*.py")]


def test_every_variable_the_code_reads_is_documented_and_back() -> None:
    documented = set(VARIABLE.findall(CONFIGURATION.read_text()))
    read = code_variables([*PRODUCT, *TESTS])
    read.pop("TP_LLAMA_API_H", None)  # api.h's include guard, which tests/test_kernel_build.py names
    assert not set(code_variables(PRODUCT)) - documented, "read by the product, missing in docs/configuration.md"
    assert not set(read) - documented, "read by the tests, missing in docs/configuration.md"
    assert not documented - set(read), "named in docs/configuration.md, read nowhere"
    readme = set(VARIABLE.findall((REPO / "README.md").read_text()))
    assert not readme - set(read), "named in README.md, read nowhere"


def _timeout() -> object:
    from tp_llama.parallel.distributed import collective_timeout

    return collective_timeout()


def _matmul() -> object:
    from tp_llama.kernels import choose

    return choose(torch.device("cpu"), torch.float32)


def _kernels() -> object:
    from tp_llama.kernels.cpu import ffi

    library, why = ffi.load.__wrapped__()  # load() keeps its first answer for the process
    return (library.variant if library is not None else None), why


def _next_tile() -> object:
    from tp_llama.kernels.cpu import ffi

    return ffi.next_tile_min_chunks("AuthenticAMD")


# The variables of configuration.md's table: how each is read, and values it must refuse.
READERS: dict[str, tuple[Callable[[], object], list[str]]] = {
    "TP_LLAMA_COLLECTIVE_TIMEOUT_S": (_timeout, ["abc", "0", "-5", "nan", "inf"]),
    "TP_LLAMA_MATMUL": (_matmul, ["bogus", "AMX"]),
    "TP_LLAMA_KERNELS": (_kernels, ["avx1024", "avx2,avx512"]),
    "TP_LLAMA_NEXT_TILE_MIN_CHUNKS": (_next_tile, ["0", "two", "-1"]),
}


def table_variables() -> list[str]:
    return [name for first in table_rows(CONFIGURATION) for name in VARIABLE.findall(first)]


def test_every_table_variable_has_its_empty_and_bad_values_checked() -> None:
    assert sorted(table_variables()) == sorted(READERS), "a variable in the table needs its row in READERS"


@pytest.mark.parametrize("name", sorted(READERS))
def test_an_empty_value_is_unset_and_a_bad_one_is_refused_by_name(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    read, bad_values = READERS[name]
    monkeypatch.delenv(name, raising=False)
    unset = read()
    monkeypatch.setenv(name, "")
    assert read() == unset
    for bad in bad_values:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=re.escape(f"{name}={bad!r}")):
            read()
