"""The C kernels as a library: one header whose structs, constants and signatures Python reads and
checks against the built library, one build per machine under a lock, a clear fallback, and a
non-editable install that can still build them."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.compilers import unoptimised_compiler
from tp_llama.kernels.cpu import build as cpu_build
from tp_llama.kernels.cpu import ffi
from tp_llama.kernels.cpu.build import COMMON_FLAGS, HEADERS, HERE, SOURCES, VARIANTS, runnable

REPO = Path(__file__).resolve().parents[1]
COMPILER = shutil.which("gcc") or shutil.which("cc")
CAN_BUILD = COMPILER is not None and bool(runnable())
needs_build = pytest.mark.skipif(not CAN_BUILD, reason="needs AVX2 or AVX-512 and a C compiler to build the kernels")


def build_edited(tmp_path: Path, edit: dict[str, tuple[str, str]]) -> tuple[Path, str]:
    """The kernels built (unoptimised: layouts do not depend on it) from sources with `edit` applied:
    file -> (old text, new text). Returns the library and the header it was built from."""
    for name in (*SOURCES, *HEADERS):
        text = (HERE / name).read_text()
        if name in edit:
            old, new = edit[name]
            assert old in text, f"{old!r} not in {name}"
            text = text.replace(old, new)
        (tmp_path / name).write_text(text)
    library = tmp_path / "kernels.so"
    subprocess.run([COMPILER, "-O0", *COMMON_FLAGS[1:], *VARIANTS[runnable()[0]][1], "-o", str(library),
                    *(str(tmp_path / s) for s in SOURCES)], check=True, capture_output=True, timeout=300)
    return library, (tmp_path / "api.h").read_text()


def test_the_header_parses_into_every_struct_function_and_constant():
    structs, functions, constants = ffi.parse_header((HERE / "api.h").read_text())
    assert [f for f, *_ in structs["DecodeRows"]] == ["rows", "width", "rotation", "tables", "positions", "adapters"]
    assert ("cache_v", "void", True) in structs["DecodeLayer"] and ("eps", "float", False) in structs["DecodeLayer"]
    assert functions["decode_stack"] == (("int", False), [("struct DecodeLayer", True), ("int64_t", False),
                                                           ("struct DecodeRows", True), ("void", True),
                                                           ("void", True), ("void", True), ("int", False)])
    assert {"TILE_COLS", "GATE_RUN", "MAX_HEAD_DIM", "TPL_OK", "TPL_OFF_CACHE"} <= set(constants)
    assert "TP_LLAMA_API_H" not in constants  # the include guard has no value


@needs_build
def test_the_library_describes_what_python_reads():
    lib, why = ffi.load()
    assert lib is not None, why
    assert lib.constants["TILE_COLS"] == 32 and lib.constants["TPL_OFF_CACHE"] == -2
    rows = lib.structs["DecodeRows"]
    assert ctypes.sizeof(rows) == lib.tpl_struct_size(b"DecodeRows") == 48
    assert lib.decode_stack.argtypes[0] is ctypes.POINTER(lib.structs["DecodeLayer"])


@needs_build
def test_a_python_struct_that_disagrees_with_the_library_is_refused():
    lib, _ = ffi.load()
    good = lib.structs["DecodeRows"]
    swapped = type("DecodeRows", (ctypes.Structure,), {"_fields_": [good._fields_[1], good._fields_[0], *good._fields_[2:]]})
    with pytest.raises(ffi.LayoutError, match="DecodeRows.width: at byte 8 in the library, 0 by api.h"):
        ffi.check_layout(lib.lib, swapped)
    full = lib.structs["DecodeLayer"]
    short = type("DecodeLayer", (ctypes.Structure,), {"_fields_": full._fields_[:-1]})
    with pytest.raises(ffi.LayoutError, match=f"struct DecodeLayer: the library's is {ctypes.sizeof(full)} bytes, "
                                              f"api.h's {ctypes.sizeof(short)}"):
        ffi.check_layout(lib.lib, short)


@needs_build
@pytest.mark.parametrize(("edit", "message"), [
    ({"api.h": ("    int64_t rows, width;\n", "    int64_t rows, width, spare;\n")},
     r"DecodeRows.* 56 bytes, api.h's 56|DecodeRows.spare"),
    ({"api.h": ("#define MAX_HEAD_DIM 256", "#define MAX_HEAD_DIM 256\n#define SPARE_ROWS 4")},
     "constant SPARE_ROWS of api.h is unknown to the library"),
    ({"abi.c": ("FIELD(DecodeRows, tables),", "")}, r"DecodeRows.tables: at byte -1 in the library"),
], ids=["field-added-to-the-header", "constant-added-to-the-header", "field-missing-from-the-library"])
def test_a_header_and_library_that_disagree_are_refused(tmp_path: Path, edit: dict, message: str):
    library, header = build_edited(tmp_path, edit)
    with pytest.raises(ffi.LayoutError, match=message):
        ffi.Library(library, header)


@pytest.mark.skipif(COMPILER is None, reason="needs a C compiler")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_compiles_on_any_x86_64(tmp_path: Path, variant: str):
    """Compiling needs no CPU support, so each variant must compile here, whatever this CPU runs: at -O0,
    where no constant is folded into an intrinsic's immediate and an intrinsic of an instruction set
    the flags lack still fails to inline (the -O3 build of the variant this CPU runs is what every
    other kernel test loads). The sources compile side
    by side (-c: a shared library links nothing that could fail)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the variants are x86-64 code")
    flags = ["-O0", *COMMON_FLAGS[1:], *VARIANTS[variant][1], "-c"]
    procs = [subprocess.Popen([COMPILER, *flags, "-o", str(tmp_path / f"{source}.o"), str(HERE / source)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for source in SOURCES]
    errors = [err for proc in procs if (err := proc.communicate(timeout=300)[1]) and proc.returncode]
    assert not errors, "\n".join(errors)[-3000:]


@needs_build
def test_ranks_starting_together_build_once(tmp_path: Path):
    """Three processes ask for the library of a cold cache at once: one compiles, the others wait for it.
    The compiler, counting its calls, builds at -O0: the lock and the cache are what is tested."""
    log = tmp_path / "compiles.log"
    wrapper = unoptimised_compiler(tmp_path, COMPILER, log)
    script = ("import sys; from tp_llama.kernels.cpu.build import build; "
              f"print(build('avx512', [{str(wrapper)!r}]))")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(3)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), [err for _, err in outputs]
    assert len({out.strip() for out, _ in outputs}) == 1
    assert len(log.read_text().split()) == 1


def test_a_failed_build_falls_back_to_onednn_and_says_why(tmp_path: Path):
    script = ("import torch; from tp_llama.kernels import choose; "
              "print(choose(torch.device('cpu'), torch.float32))")
    env = {**os.environ, "CC": "false", "XDG_CACHE_HOME": str(tmp_path / "cache"), "TMPDIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    kind, why = eval(run.stdout.strip())  # noqa: S307 - our own repr of a tuple of two strings
    assert kind in ("onednn", "plain")
    assert ("false failed on tp_llama's C kernels" in why) if CAN_BUILD else why


@needs_build
def test_a_non_editable_install_builds_the_kernels(tmp_path: Path):
    """`pip install .` ships the C sources and the headers they include, so the installed copy builds
    (at -O0: that the files are there and compile is the point, not the optimised code)."""
    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                              "--target", str(target), str(REPO)], capture_output=True, text=True, timeout=600,
                             cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-3000:]
    assert {p.name for p in (target / "tp_llama" / "kernels" / "cpu").iterdir()} >= {*SOURCES, *HEADERS}
    script = ("import tp_llama; from tp_llama.kernels.cpu import ffi; lib, why = ffi.load(); "
              "print(tp_llama.__file__, lib.path if lib else why)")
    env = {**os.environ, "PYTHONPATH": str(target), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "CC": unoptimised_compiler(tmp_path, COMPILER)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    module, library = run.stdout.split()
    assert module.startswith(str(target)) and library.startswith(str(tmp_path / "cache")), run.stdout


def writing_compiler(folder: Path, refuse: str = "") -> str:
    """A stand-in compiler that writes "built" to its -o path, and fails on the flag `refuse` as an older
    compiler lacking it would: the cache and the reports are tested here, not the code."""
    cc = folder / "cc"
    refusal = ""
    if refuse:
        refusal = f'case " $* " in *" {refuse} "*) echo "unrecognized option {refuse}" >&2; exit 1;; esac\n'
    version = '[ "$1" = --version ] && { echo "stand-in cc ${STAND_IN_VERSION:-1}"; exit 0; }\n'
    cc.write_text(f'#!/bin/sh\n{version}{refusal}while [ "$1" != -o ]; do shift; done\necho built > "$2"\n')
    cc.chmod(0o755)
    return str(cc)


@pytest.mark.parametrize("owner", ["another-user", "every-user"])
def test_a_cache_folder_another_user_could_fill_is_passed_over(monkeypatch, tmp_path: Path, owner: str):
    """Without a writable user cache the library goes to a per-user folder in the shared temp folder, which
    another user can make first, a library of theirs inside: a folder neither this user's nor root's, or one
    every user may write, is never loaded from."""
    cc, shared, own = writing_compiler(tmp_path), tmp_path / "shared", tmp_path / "own"
    monkeypatch.setattr(cpu_build, "_cache_dirs", lambda: [tmp_path / "first"])
    name = cpu_build.build("avx2", [cc]).name
    shared.mkdir()
    (shared / name).write_text("planted")
    if owner == "every-user":
        shared.chmod(0o777)
    elif os.getuid() == 0:
        os.chown(shared, 54321, -1)
    else:
        pytest.skip("only root can give a folder to another user")
    monkeypatch.setattr(cpu_build, "_cache_dirs", lambda: [shared])
    with pytest.raises(OSError, match="owned by uid 54321|writable by every user"):
        cpu_build.build("avx2", [cc])
    monkeypatch.setattr(cpu_build, "_cache_dirs", lambda: [shared, own])
    library = cpu_build.build("avx2", [cc])
    assert library.parent == own and library.read_text() == "built\n"


def test_cc_with_arguments_is_split_and_a_new_compiler_version_builds_anew(monkeypatch, tmp_path: Path):
    """CC may carry arguments (`ccache gcc`), split as a shell splits them; and the library's name holds the
    compiler's version, so a compiler upgraded at the same path builds again instead of loading the old build."""
    cc = writing_compiler(tmp_path)
    monkeypatch.setattr(cpu_build, "_cache_dirs", lambda: [tmp_path / "cache"])
    monkeypatch.setenv("CC", f"env STAND_IN=1 {cc}")  # a wrapper with arguments, as `ccache gcc` is
    command = cpu_build.compiler()
    assert command == ["env", "STAND_IN=1", cc]
    monkeypatch.setenv("CC", 'gcc "-O2')
    with pytest.raises(ValueError, match="CC='gcc \"-O2' does not read as a command"):
        cpu_build.compiler()
    cpu_build._version.cache_clear()
    try:
        first = cpu_build.build("avx2", command)
        assert first.read_text() == "built\n" and cpu_build.build("avx2", command) == first
        monkeypatch.setenv("STAND_IN_VERSION", "2")
        cpu_build._version.cache_clear()
        second = cpu_build.build("avx2", command)
        assert second != first and second.read_text() == "built\n"
    finally:
        cpu_build._version.cache_clear()


def test_building_ahead_reports_a_variant_the_compiler_cannot_build_and_builds_the_rest(monkeypatch, tmp_path: Path,
                                                                                          capsys):
    """setup_model.sh builds every variant the CPU runs (set -e): a compiler without -mavxvnni (gcc 10) on
    an Alder Lake must not stop it before the avx2 build, which loading falls back to."""
    monkeypatch.setenv("CC", writing_compiler(tmp_path, refuse="-mavxvnni"))
    monkeypatch.setattr(cpu_build, "_cache_dirs", lambda: [tmp_path / "cache"])
    monkeypatch.setattr(cpu_build, "unsupported", lambda variant, flags=None: "" if "avx2" in variant else "faked")
    assert cpu_build.main() == 0
    report = capsys.readouterr().err
    assert "avx2-vnni: not built (" in report and "unrecognized option -mavxvnni" in report
    assert f"avx2: {tmp_path / 'cache'}" in report
    monkeypatch.setenv("CC", "false")  # a compiler that builds nothing: a failure setup_model.sh stops at
    assert cpu_build.main() == 1
