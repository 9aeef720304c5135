"""The tree's layers, read from the code's imports: each layer imports only the layers below it, no
module imports another in a circle (function-local imports included), the product never imports
tp_llama.testing, and no module grows past the size a reader takes in at once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 400
# Lowest first: a module may import its own layer and the ones before it, never one after.
LAYERS = [
    ["tp_llama.errors", "tp_llama.pages", "tp_llama.llama4_format", "tp_llama.tokenizer", "tp_llama.json_schema",
     "tp_llama.tool_format", "tp_llama.tool_calls"],
    ["tp_llama.model"],
    ["tp_llama.kernels"],
    ["tp_llama.parallel"],
    ["tp_llama.checkpoint"],
    ["tp_llama.backend", "tp_llama.config"],
    ["tp_llama.lora"],
    ["tp_llama.engine"],
    ["tp_llama.serving"],
    ["tp_llama.cli", "handler"],
]
# The documented entry points kept at their old names, each a re-export of its new home.
SHIMS = {"tp_llama.checkpoint_converter", "tp_llama.generate", "tp_llama.synthetic"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    paths = [*REPO.glob("tp_llama/**/*.py"), *REPO.glob("handler/*.py")]
    return {module_name(p): p for p in paths if "testing" not in p.relative_to(REPO).parts}


def imports(path: Path) -> set[str]:
    """Every tp_llama (or handler) module this file imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] in ("tp_llama", "handler")}


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module an imported name lives in (`from a.b import f` names a.b.f: its module is a.b)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def layer_of(module: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer of LAYERS: place it")


def graph() -> dict[str, set[str]]:
    modules = product_modules()
    edges = {}
    for name, path in modules.items():
        targets = {resolve(i, modules) for i in imports(path)} - {None, name}
        edges[name] = {t for t in targets if not (name.startswith(t + ".") or t == "tp_llama")}
    return edges


def test_every_layer_imports_only_the_layers_below_it():
    wrong = []
    for module, targets in graph().items():
        if module in SHIMS or module == "tp_llama":
            continue
        for target in targets:
            if target not in SHIMS and layer_of(target) > layer_of(module):
                wrong.append(f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_the_product_never_imports_the_testing_package():
    offenders = [m for m, path in product_modules().items() if m not in SHIMS
                 and any(i.startswith("tp_llama.testing") for i in imports(path))]
    assert not offenders


@pytest.mark.parametrize("path", sorted(p.relative_to(REPO) for p in product_modules().values()), ids=str)
def test_modules_stay_small(path: Path):
    lines = len((REPO / path).read_text().splitlines())
    assert lines <= MAX_LINES, f"{path} has {lines} lines"


def test_the_checker_sees_a_cycle_and_a_layer_broken(monkeypatch):
    """The checks above must be able to fail: a model module importing the engine breaks both."""
    real = imports
    model_file = REPO / "tp_llama" / "model" / "llama.py"
    monkeypatch.setitem(globals(), "imports",
                        lambda path: real(path) | ({"tp_llama.engine.core"} if path == model_file else set()))
    with pytest.raises(AssertionError, match="tp_llama.model.llama .layer 1. imports tp_llama.engine.core"):
        test_every_layer_imports_only_the_layers_below_it()
    with pytest.raises(AssertionError, match="tp_llama.model.llama"):
        test_no_import_cycles()


def test_the_handler_file_defines_one_class():
    """TorchServe refuses a handler module that defines more than one class."""
    tree = ast.parse((REPO / "handler" / "llama_handler.py").read_text())
    assert [node.name for node in tree.body if isinstance(node, ast.ClassDef)] == ["LlamaHandler"]
