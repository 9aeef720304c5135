"""Building the C kernels: once per machine and source, at first use or ahead of time, under a lock.

    python -m tp_llama.kernels.cpu.build      # build now and print where (setup_model.sh does)

The library is kept in the user's cache, named by a digest of the sources, headers, compiler (its
command and version) and flags, so an edited source is rebuilt and an unchanged one never is. Ranks
that start together wait on one lock while the first of them compiles.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = ("matmul.c", "quant.c", "layer.c", "decode.c", "sample.c", "lora.c", "amx.c", "prompt_attention.c", "abi.c")
HEADERS = ("api.h", "simd.h")
COMMON_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
# Each variant: the CPU flags it needs (/proc/cpuinfo names) and the compiler flags that use them;
# the first this CPU (and compiler) can run is loaded.
_AVX512 = (("avx512f", "avx512bw", "avx512vl", "fma", "f16c"), ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"])
VARIANTS = {
    "avx512-amx": ((*_AVX512[0], "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"),
                   [*_AVX512[1], "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"]),
    "avx512-bf16": ((*_AVX512[0], "avx512_bf16", "avx512_vnni"), [*_AVX512[1], "-mavx512bf16", "-mavx512vnni"]),  # Zen 4/5
    "avx512-vnni": ((*_AVX512[0], "avx512_vnni"), [*_AVX512[1], "-mavx512vnni"]),  # Cascade Lake, Ice Lake
    "avx512": _AVX512,  # Skylake-SP
    "avx2-vnni": (("avx2", "fma", "f16c", "avx_vnni"), ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"]),  # Alder Lake on
    "avx2": (("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),  # AMD's Zen 2/3, Intel before Skylake-SP
}
BUILD_TIMEOUT_S = 300


def _cpuinfo(field: str) -> list[str]:
    """The words after the colon of /proc/cpuinfo's first `field` line (none where there is none)."""
    try:
        with open("/proc/cpuinfo") as info:
            line = next((line for line in info if line.startswith(field)), "")
    except OSError:
        return []
    return line.partition(":")[2].split()


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return set(_cpuinfo("flags"))


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id: "GenuineIntel", "AuthenticAMD", or "" where there is none."""
    return " ".join(_cpuinfo("vendor_id"))


def unsupported(variant: str, flags: set[str] | None = None) -> str:
    """Why this CPU cannot run `variant` ("" when it can)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"no {variant} on {platform.machine()}"
    missing = set(VARIANTS[variant][0]) - (cpu_flags() if flags is None else flags)
    return f"the CPU lacks {', '.join(sorted(missing))}" if missing else ""


def runnable(flags: set[str] | None = None) -> list[str]:
    """The variants a CPU with these flags (this CPU's by default) can run, best first."""
    flags = cpu_flags() if flags is None else flags
    return [variant for variant in VARIANTS if not unsupported(variant, flags)]


def compiler() -> list[str] | None:
    """The C compiler's command: $CC split as a shell would (`ccache gcc`), else gcc or cc on the PATH."""
    if os.environ.get("CC", "").strip():
        try:
            return shlex.split(os.environ["CC"])
        except ValueError as exc:
            raise ValueError(f"CC={os.environ['CC']!r} does not read as a command: {exc}") from None
    found = shutil.which("gcc") or shutil.which("cc")
    return [found] if found else None


@functools.cache
def _version(cc: tuple[str, ...]) -> str:
    """The compiler's `--version` text: part of the library's digest, so an upgraded compiler at the same
    path builds anew (its code may differ)."""
    try:
        run = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise OSError(f"the C compiler {shlex.join(cc)} does not run: {exc}") from exc
    return run.stdout


def _cache_dirs() -> list[Path]:
    """Where the library is kept: the user's cache, else a per-user temp folder (e.g. no HOME)."""
    folders = [Path(tempfile.gettempdir()) / f"tp_llama-{os.getuid()}"]
    try:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except RuntimeError:  # no HOME and no passwd entry, as in some service sandboxes
        return folders
    return [cache / "tp_llama", *folders]


def _untrusted(folder: Path) -> str:
    """Why a library in `folder` could be another user's ("" when it cannot): a folder someone else owns
    (root aside), or one every user may write, as one planted in a shared temp folder would be."""
    info = folder.stat()
    if info.st_uid not in (os.getuid(), 0):
        return f"owned by uid {info.st_uid}, not this user's {os.getuid()}"
    return "writable by every user" if info.st_mode & 0o002 else ""


def build(variant: str, cc: list[str]) -> Path:
    """The compiled library of `variant`, from the cache when it was built before.

    TP_LLAMA_KERNELS_TEST_DEFINES: -D flags for the tests alone (tests/test_kernels.py builds a
    library that breaks batch invariance on purpose, to see its tests fail)."""
    defines = os.environ.get("TP_LLAMA_KERNELS_TEST_DEFINES", "").split()
    if any(not flag.startswith("-D") for flag in defines):
        raise ValueError(f"TP_LLAMA_KERNELS_TEST_DEFINES takes -D flags only, not {defines}")
    flags = [*COMMON_FLAGS, *VARIANTS[variant][1], *defines]
    code = b"".join((HERE / name).read_bytes() for name in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(code + "\n".join([*cc, _version(tuple(cc)), *flags]).encode()).hexdigest()[:16]
    errors = []
    for folder in _cache_dirs():
        library = folder / f"cpu_kernels-{variant}-{digest}.so"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if why := _untrusted(folder):
                errors.append(f"{folder}: {why}")
                continue
            if library.is_file():
                return library
            lock = open(folder / f"{library.name}.lock", "w")
        except OSError as exc:
            errors.append(f"{folder}: {exc}")
            continue
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
            if library.is_file():  # another process built it while this one waited
                return library
            partial = folder / f"{library.name}.{os.getpid()}.tmp"
            try:
                subprocess.run([*cc, *flags, "-o", str(partial), *(str(HERE / s) for s in SOURCES)],
                               check=True, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except subprocess.CalledProcessError as exc:
                partial.unlink(missing_ok=True)
                raise OSError(f"{shlex.join(cc)} failed on tp_llama's C kernels: {exc.stderr.strip()[-2000:]}") from exc
            os.replace(partial, library)
            return library
    raise OSError("no usable cache folder: " + "; ".join(errors))


def main() -> int:
    """Build every variant this CPU runs (`python -m tp_llama.kernels.cpu`), saying why others are not.

    A variant that fails to build is reported and the next tried, as loading does (an older compiler may
    lack one's flags); the status is 1 only where a compiler built none of those this CPU runs."""
    built = failed = 0
    for variant in VARIANTS:
        why = unsupported(variant)
        cc = compiler()
        if not why and cc is None:
            why = "no C compiler"
        if not why:
            try:
                print(f"{variant}: {build(variant, cc)}", file=sys.stderr)
                built += 1
                continue
            except (OSError, subprocess.SubprocessError) as exc:
                why, failed = str(exc), failed + 1
        print(f"{variant}: not built ({why})", file=sys.stderr)
    return 1 if failed and not built else 0

