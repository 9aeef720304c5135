"""Gather what the GPU test machine lacks for serving into one ignored folder (default .gpu-bundle).

    python -m checks.gpu_bundle [--out .gpu-bundle] [--java]

That machine has PyTorch with CUDA, tiktoken, sentencepiece, PyYAML, psutil, Pillow and packaging
(the device tool's KINDS.md lists its image), but no TorchServe, no llguidance, no Java and no
network. Its files come from the tree of `carry`, at most 64 MiB a call, so the bundle fails above
LIMIT_MIB. It holds, copied from this environment (pure Python, or abi3 builds any CPython 3.x
loads):

- `ts`, TorchServe's Python side (the worker, its socket protocol, BaseHandler), without
  `ts/frontend/model-server.jar`: the Java frontend;
- `model_archiver`, which deploy/make_archive.py builds the model folder with (its one requirement,
  enum-compat, installs no module on Python 3);
- `llguidance`, which the handler's structured outputs compile grammars with;
- `tokenizer.model`, Meta's Llama 3 tokenizer as llama-models ships it (the 8B-shaped check's).

Put it first on PYTHONPATH there. --java also measures TorchServe's frontend with a Java runtime
cut by jlink to the modules it needs, and adds them only if all of it still fits: it does not (the
jar alone is 44 MiB; BENCHMARKS.md, "H100 / H200"), so checks/ts_frontend.py stands in for it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMIT_MIB = 60
PACKAGES = ("ts", "model_archiver", "llguidance")
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "model-server.jar")
JAVA_MODULES = "java.base,java.logging,java.management,java.naming,java.sql,java.xml,jdk.unsupported"


def size_mib(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


def package_source(name: str) -> Path:
    """A package's folder, as this Python imports it."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(f"gpu_bundle: {name} is not installed here; pip install -r requirements.txt")
    return Path(spec.origin).parent


def dist_info(package: str) -> Path:
    """The installed distribution's metadata folder (NAME-VERSION.dist-info) for a top-level package."""
    name = importlib.metadata.packages_distributions()[package][0]
    dist = importlib.metadata.distribution(name)
    found = Path(dist.locate_file(f"{name.replace('-', '_')}-{dist.version}.dist-info"))
    if not found.is_dir():
        raise SystemExit(f"gpu_bundle: no metadata folder {found} for {name}")
    return found


def llama3_tokenizer() -> Path:
    source = package_source("llama_models") / "llama3" / "tokenizer.model"
    if not source.is_file():
        raise SystemExit(f"gpu_bundle: {source} is missing; pip install -r requirements-test.txt")
    return source


def java_parts(out: Path) -> dict[str, float]:
    """The frontend's jar and a jlink-cut runtime, written under out/java; their sizes in MiB."""
    jar = package_source("ts") / "frontend" / "model-server.jar"
    jlink = shutil.which("jlink")
    if jlink is None:
        raise SystemExit("gpu_bundle: --java needs jlink (a JDK 17) on PATH")
    runtime = out / "java" / "runtime"
    shutil.rmtree(runtime, ignore_errors=True)
    subprocess.run([jlink, "--add-modules", JAVA_MODULES, "--compress=2", "--strip-debug", "--no-header-files",
                    "--no-man-pages", "--output", str(runtime)], check=True, capture_output=True)
    shutil.copy2(jar, out / "java" / jar.name)
    return {"java runtime (jlink)": size_mib(runtime), "model-server.jar": size_mib(jar)}


def build(out: Path, java: bool = False) -> dict[str, float]:
    """Write the bundle to `out` (replacing it); returns each part's size in MiB. Exits above LIMIT_MIB."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    sizes = {}
    for name in PACKAGES:
        source = package_source(name)
        shutil.copytree(source, out / source.name, ignore=SKIP)
        info = dist_info(name)  # llguidance reads its own version from it at import
        shutil.copytree(info, out / info.name)
        sizes[name] = size_mib(out / source.name) + size_mib(out / info.name)
    shutil.copy2(llama3_tokenizer(), out / "tokenizer.model")
    sizes["tokenizer.model"] = size_mib(out / "tokenizer.model")
    # The commit the bundle goes with: the GPU machine gets the working tree without .git (checks/gpu_run.sh prints it)
    described = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                               text=True, check=False)
    (out / "COMMIT").write_text(described.stdout.strip() or "unknown")
    if java:
        sizes.update(java_parts(out))
    total = sum(sizes.values())
    if total > LIMIT_MIB:
        shutil.rmtree(out, ignore_errors=True)
        listing = ", ".join(f"{name} {mib:.1f}" for name, mib in sizes.items())
        raise SystemExit(f"gpu_bundle: {total:.1f} MiB is over the {LIMIT_MIB} MiB limit ({listing} MiB); "
                         "leave out --java")
    return sizes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / ".gpu-bundle")
    parser.add_argument("--java", action="store_true", help="add TorchServe's frontend and a jlink-cut Java")
    a = parser.parse_args(argv)
    sizes = build(a.out, a.java)
    for name, mib in sizes.items():
        print(f"{name:24s} {mib:6.1f} MiB")
    print(f"{'total':24s} {sum(sizes.values()):6.1f} MiB in {a.out} (limit {LIMIT_MIB})", file=sys.stderr)


if __name__ == "__main__":
    main()
