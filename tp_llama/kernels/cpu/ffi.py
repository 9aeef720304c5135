"""The C library as Python calls it, with nothing restated by hand.

Signatures and struct fields are read from api.h (the header the library was compiled from),
each constant's value from the library itself, and every struct's size and field offsets are
checked against the library's own (abi.c) before a kernel runs: a header and a library that
disagree are refused with the reason, never run.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import subprocess
from pathlib import Path

from tp_llama.kernels.cpu.build import (
    VARIANTS,
    build,
    compiler,
    cpu_vendor,
    runnable,
    unsupported,
)

HEADER = Path(__file__).with_name("api.h")
_SCALARS = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
            "double": ctypes.c_double}


class LayoutError(OSError):
    """The library's structs or constants are not what api.h says."""


def _declaration(text: str) -> tuple[str, bool, str]:
    """`const int64_t *slots` -> ("int64_t", True, "slots"): base type, pointer, name ("" for a bare type)."""
    tokens = [t for t in text.replace("*", " * ").split() if t != "const"]
    pointer = "*" in tokens
    tokens = [t for t in tokens if t != "*"]
    if tokens[0] == "struct":
        base, rest = f"struct {tokens[1]}", tokens[2:]
    else:
        base, rest = tokens[0], tokens[1:]
    return base, pointer, rest[0] if rest else ""


def parse_header(text: str) -> tuple[dict[str, list[tuple[str, str, bool]]], dict[str, tuple], list[str]]:
    """(structs: name -> [(field, base type, pointer)], functions: name -> (return, [(base, pointer)]), constant names)."""
    constants = re.findall(r"^#define[ \t]+([A-Z_][A-Z0-9_]*)[ \t]+\S", text, flags=re.M)
    code = re.sub(r"/\*.*?\*/|//[^\n]*|^#[^\n]*", "", text, flags=re.S | re.M)
    structs = {}
    for name, body in re.findall(r"struct\s+(\w+)\s*\{(.*?)\}\s*;", code, flags=re.S):
        fields = []
        for statement in filter(str.strip, body.split(";")):
            first, *more = statement.split(",")
            base, pointer, field = _declaration(first)
            fields.append((field, base, pointer))
            for extra in more:  # `const void *a, *b`: the same base type
                _, extra_pointer, extra_name = _declaration(f"{base} {extra}")
                fields.append((extra_name, base, extra_pointer))
        structs[name] = fields
    code = re.sub(r"struct\s+\w+\s*\{.*?\}\s*;", "", code, flags=re.S)
    functions = {}
    for statement in filter(str.strip, code.split(";")):
        head, _, args = " ".join(statement.split()).partition("(")
        ret_base, ret_pointer, name = _declaration(head)
        params = [_declaration(a)[:2] for a in args.rstrip(")").split(",") if a.strip() not in ("", "void")]
        functions[name] = ((ret_base, ret_pointer), params)
    return structs, functions, constants


def _ctype(base: str, pointer: bool, structs: dict[str, type]):
    if pointer:
        if base.startswith("struct "):
            return ctypes.POINTER(structs[base[7:]])
        return ctypes.c_char_p if base == "char" else ctypes.c_void_p
    return None if base == "void" else _SCALARS[base]


def check_layout(lib: ctypes.CDLL, struct: type[ctypes.Structure]) -> None:
    """Raise LayoutError unless the library lays `struct` out as ctypes does: size and every field's offset."""
    name = struct.__name__.encode()
    size = lib.tpl_struct_size(name)
    if size != ctypes.sizeof(struct):
        raise LayoutError(f"struct {struct.__name__}: the library's is {size} bytes, api.h's {ctypes.sizeof(struct)}")
    for field, _ in struct._fields_:
        offset = lib.tpl_field_offset(name, field.encode())
        if offset != getattr(struct, field).offset:
            raise LayoutError(f"struct {struct.__name__}.{field}: at byte {offset} in the library, "
                              f"{getattr(struct, field).offset} by api.h")


class Library:
    """The loaded kernels: its functions as attributes, `structs[name]`, `constants[name]`."""

    def __init__(self, path: Path, header: str, variant: str = ""):
        self.path, self.variant = path, variant
        self.next_tile_min_chunks = 1  # what load() sets
        self.lib = ctypes.CDLL(str(path))  # torch is loaded, so its OpenMP is the one the library uses
        struct_fields, functions, names = parse_header(header)
        for name in ("tpl_struct_size", "tpl_field_offset", "tpl_constant"):
            getattr(self.lib, name).restype = ctypes.c_int64
        self.structs: dict[str, type[ctypes.Structure]] = {}
        for name, fields in struct_fields.items():
            layout = [(field, _ctype(base, pointer, self.structs)) for field, base, pointer in fields]
            self.structs[name] = type(name, (ctypes.Structure,), {"_fields_": layout})
            check_layout(self.lib, self.structs[name])
        for name, ((ret_base, ret_pointer), params) in functions.items():
            function = getattr(self.lib, name)
            function.restype = _ctype(ret_base, ret_pointer, self.structs)
            function.argtypes = [_ctype(base, pointer, self.structs) for base, pointer in params]
        self.constants: dict[str, int] = {}
        for name in names:
            value = ctypes.c_int64()
            if self.lib.tpl_constant(name.encode(), ctypes.byref(value)):
                raise LayoutError(f"constant {name} of api.h is unknown to the library")
            self.constants[name] = value.value

    def __getattr__(self, name: str):
        return getattr(self.lib, name)


@functools.cache
def load() -> tuple[Library | None, str]:
    """(the kernels of the first variant this CPU runs and this compiler builds, "") or (None, why not).

    TP_LLAMA_KERNELS names the variant to load instead (e.g. avx2 on an AVX-512 CPU, to compare).
    """
    cc = compiler()
    variants = runnable()
    forced = os.environ.get("TP_LLAMA_KERNELS") or None  # set but empty: as if unset
    if forced is not None:
        if forced not in VARIANTS:
            raise ValueError(f"TP_LLAMA_KERNELS={forced!r}: choose one of {', '.join(VARIANTS)}")
        if forced not in variants:
            return None, f"TP_LLAMA_KERNELS={forced}: {unsupported(forced)}"
        variants = [forced]
    if not variants:
        return None, unsupported("avx2")
    reasons = []
    for variant in variants:
        if cc is None:
            return None, "no C compiler (gcc) to build tp_llama's C kernels"
        try:
            library = Library(build(variant, cc), HEADER.read_text(), variant)
        except (OSError, subprocess.SubprocessError) as exc:
            reasons.append(f"{variant}: could not build or load tp_llama's C kernels: {exc}")
            continue
        library.next_tile_min_chunks = next_tile_min_chunks(cpu_vendor())
        library.set_next_tile_min_chunks(library.next_tile_min_chunks)
        return library, ""
    return None, "; ".join(reasons)


def next_tile_min_chunks(vendor: str) -> int:
    """How many chunks of rows a tile call needs before it prefetches the next tile (api.h).

    On Intel those prefetches keep more lines in flight than the core's own fill buffers; on a
    Zen 5 EPYC they slow a one-row pass past oneDNN's and still help from 2 chunks
    (bench/kernels/matmul.py).
    TP_LLAMA_NEXT_TILE_MIN_CHUNKS sets it instead, to compare.
    """
    forced = os.environ.get("TP_LLAMA_NEXT_TILE_MIN_CHUNKS") or None  # set but empty: as if unset
    if forced is None:
        return 2 if vendor == "AuthenticAMD" else 1
    if not forced.isdigit() or int(forced) < 1:
        raise ValueError(f"TP_LLAMA_NEXT_TILE_MIN_CHUNKS={forced!r}: a whole number of chunks, 1 or more")
    return int(forced)


@functools.cache
def amx_ready() -> bool:
    """The loaded kernels run AMX here: built for it, and Linux lends this process the tile state."""
    lib = load()[0]
    return lib is not None and lib.variant.endswith("-amx") and lib.amx_enable() == lib.constants["TPL_OK"]


def library() -> Library:
    """The loaded kernels (callers have checked that `load` succeeded)."""
    lib, why = load()
    if lib is None:
        raise RuntimeError(why)
    return lib
