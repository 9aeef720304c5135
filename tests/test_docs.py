"""The documentation holds together: links resolve, pages stay short enough to read, and every setting
the code accepts is documented.

- Every relative link in README.md, ARCHITECTURE.md, BENCHMARKS.md and docs/**/*.md names a file that
  exists, and a `#anchor` names a heading of that file (GitHub's slugs).
- README.md has at most 300 lines and BENCHMARKS.md at most 400; README.md links every page of docs/
  (the dated pages of docs/perf-log may be linked from BENCHMARKS.md instead); README.md opens with
  the two commands CI and users rely on.
- Every field of tp_llama.config.EngineConfig and of the dataclasses of tp_llama/serving/settings.py,
  and every key of model-config.yaml, is named in docs/configuration.md as `key` (or `handler.key`,
  `torchrun.key`).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = REPO / "README.md"
BENCHMARKS = REPO / "BENCHMARKS.md"
CONFIGURATION = DOCS / "configuration.md"
LIMITS = {"README.md": 300, "BENCHMARKS.md": 400}
TOP_COMMANDS = [
    "./setup_model.sh --serve   # fresh machine -> venv, demo checkpoint, archive, TorchServe TP=2, one completion",
    ".ci/run                    # installs what it needs, then runs the tests: .venv/bin/python -m pytest -q tests",
]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto: ...


def doc_files() -> list[Path]:
    return [README, REPO / "ARCHITECTURE.md", BENCHMARKS, *sorted(DOCS.rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered (links and code spans keep their text),
    lowercased, every character but letters, digits, spaces, hyphens and underscores dropped,
    spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = CODE_SPAN.sub(lambda m: m.group(2), text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in `path`; repeated headings get -1, -2 ... as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of each markdown link outside code."""
    found = []
    for number, line in prose_lines(path.read_text()):
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            found.append((number, match.group(1)))
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    return [(n, t) for n, t in links(path) if not EXTERNAL.match(t)]


def resolve(path: Path, target: str) -> tuple[Path, str]:
    file, _, anchor = target.partition("#")
    return ((path.parent / file).resolve() if file else path), anchor


def test_every_relative_link_resolves():
    broken = []
    for path in doc_files():
        for number, target in relative_links(path):
            where, anchor = resolve(path, target)
            name = f"{path.relative_to(REPO)}:{number}: ({target})"
            if not where.exists():
                broken.append(f"{name}: no file {where}")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                broken.append(f"{name}: no heading with anchor #{anchor} in {where.relative_to(REPO)}")
            elif anchor and where.suffix != ".md":
                broken.append(f"{name}: an anchor into a file that is not markdown")
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_the_front_pages_stay_short(name: str):
    lines = len((REPO / name).read_text().splitlines())
    assert lines <= LIMITS[name], f"{name} has {lines} lines; at most {LIMITS[name]}: move detail into docs/"


def linked_files(path: Path) -> set[Path]:
    return {resolve(path, target)[0] for _, target in relative_links(path)}


def test_readme_links_every_docs_page():
    from_readme, from_benchmarks = linked_files(README), linked_files(BENCHMARKS)
    missing = []
    for page in sorted(DOCS.rglob("*.md")):
        may_be_in_benchmarks = page.parent.name == "perf-log"
        if page.resolve() in from_readme or (may_be_in_benchmarks and page.resolve() in from_benchmarks):
            continue
        missing.append(f"{page.relative_to(REPO)} (link it from README.md"
                       + (" or BENCHMARKS.md)" if may_be_in_benchmarks else ")"))
    assert not missing, "docs pages no reader can find:\n" + "\n".join(missing)


def test_readme_opens_with_the_two_commands():
    text = README.read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no ```bash block"
    assert block.group(1).splitlines() == TOP_COMMANDS, (
        "README.md's first bash block must be exactly:\n" + "\n".join(TOP_COMMANDS) + "\ngot:\n" + block.group(1))
    first_heading = next(i for i, line in enumerate(text.splitlines()) if line.startswith("## "))
    assert text[:block.start()].count("\n") < first_heading, "the two commands must come before the first section"


def documented(names: typing.Iterable[str], prefixes: tuple[str, ...] = ("",)) -> list[str]:
    """Which of `names` docs/configuration.md does not name in backticks, as `name` or `prefix.name`."""
    text = CONFIGURATION.read_text()
    return sorted(name for name in names
                  if not any(f"`{prefix}{name}`" in text or f"`{prefix}{name}:`" in text for prefix in prefixes))


def settings_dataclasses() -> list[type]:
    from tp_llama.config import EngineConfig
    from tp_llama.serving import settings

    own = [cls for _, cls in inspect.getmembers(settings, inspect.isclass)
           if dataclasses.is_dataclass(cls) and cls.__module__ == settings.__name__]
    assert own, "tp_llama/serving/settings.py defines no settings dataclass"
    return [EngineConfig, *own]


def test_every_settings_field_is_documented():
    missing = []
    for cls in settings_dataclasses():
        hints = typing.get_type_hints(cls)
        # A field holding another settings dataclass (HandlerSettings.engine) is documented through its fields.
        names = [f.name for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[f.name])]
        missing += [f"{cls.__module__}.{cls.__name__}.{name}" for name in
                    documented(names, ("", "handler."))]
    assert not missing, "fields not documented in docs/configuration.md as `name`:\n" + "\n".join(missing)


def test_every_model_config_key_is_documented():
    config = yaml.safe_load((REPO / "model-config.yaml").read_text())
    text = CONFIGURATION.read_text()
    # A top-level key counts as `key`, `key:` or as the prefix of one of its keys (`torchrun.nproc-per-node`).
    missing = [f"{key} (top level)" for key in config if not re.search(rf"`{re.escape(key)}[.`:]", text)]
    for block, keys in config.items():
        if isinstance(keys, dict):
            missing += [f"{block}.{key}" for key in documented(keys, ("", f"{block}."))]
    assert not missing, "model-config.yaml keys not documented in docs/configuration.md:\n" + "\n".join(missing)
