#!/usr/bin/env bash
# Build llama.cpp's native anchors from the llama.cpp sources vendored in the llama-cpp-python sdist
# that edgespec runs on, outside the repository (a cache dir): `llama-speculative-simple` (the
# speculative example, bench/anchors/native.py) and `llama-server` (bench/anchors/server_anchor.py).
#
#   bench/anchors/build.sh                      # llama-speculative-simple; prints its path last
#   bench/anchors/build.sh llama-server         # llama-server; prints its path last
#   bench/anchors/build.sh llama-speculative-simple llama-server   # both, one path a line, in order
#   bench/anchors/build.sh --clean [TARGET...]  # remove the build dir first
#
# Environment:
#   TARGETS              targets to build when none is named on the command line
#                        (default llama-speculative-simple)
#   EDGESPEC_HOME        cache root (default ~/.cache/edgespec); work goes to $EDGESPEC_HOME/anchors/
#   ANCHOR_DIR           override the whole work dir
#   LLAMA_CPP_PYTHON     llama-cpp-python version (default 0.3.36, what edgespec pins)
#   LLAMA_SRC            an already-extracted sdist (dir holding vendor/llama.cpp): skips pip
#   JOBS                 parallel compile jobs (default 2)
#   PIP                  pip command (default: the repo's .venv pip, else python3 -m pip)
#
# One build dir holds every target: it is configured once with the examples, tools and server on
# (CPU only, static, no tests, no OpenSSL, no web UI download), and only the named targets (and
# what they link) are compiled. On a CPU that reports AMX (amx_tile in /proc/cpuinfo) ggml is built
# without its AMX kernels, as the repository's Makefile does for llama-cpp-python: -march=native
# turns them on, and on VMs that do not keep AMX tile state they die with SIGILL.
#
# Idempotent: the download and extraction are skipped when already done; configure runs again only
# when its arguments changed (e.g. a build dir configured before the server was added), and the
# build step is a no-op when the binaries are up to date.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON:-0.3.36}"
ROOT="${ANCHOR_DIR:-${EDGESPEC_HOME:-$HOME/.cache/edgespec}/anchors}"
JOBS="${JOBS:-2}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

if [[ -z "${PIP:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/pip" ]]; then PIP="$REPO/.venv/bin/pip"; else PIP="python3 -m pip"; fi
fi

log() { printf '[anchors] %s\n' "$*" >&2; }

CLEAN=0
targets=()
for arg in "$@"; do
    case "$arg" in
        --clean) CLEAN=1 ;;
        -h|--help) sed -n '2,29p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        llama-speculative-simple|llama-server) targets+=("$arg") ;;
        *) log "unknown argument: $arg (targets: llama-speculative-simple, llama-server; flag: --clean)"; exit 2 ;;
    esac
done
if [[ ${#targets[@]} -eq 0 ]]; then
    read -r -a targets <<< "${TARGETS:-llama-speculative-simple}"
fi
for t in "${targets[@]}"; do
    case "$t" in
        llama-speculative-simple|llama-server) ;;
        *) log "unknown target in TARGETS: $t (llama-speculative-simple, llama-server)"; exit 2 ;;
    esac
done

mkdir -p "$ROOT"
BUILD="$ROOT/build-llama-cpp-python-$VERSION"
if [[ $CLEAN -eq 1 ]]; then
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
[[ -f "$LLAMA/tools/server/server.cpp" ]] || { log "$LLAMA has no tools/server"; exit 1; }

# 2. configure (CPU only, static, examples + tools + server, no tests, no HTTPS, no UI download) ----
# LLAMA_USE_PREBUILT_UI=OFF and LLAMA_BUILD_UI=OFF: the server's web UI is neither downloaded nor
# built with npm (the server then embeds an empty UI; its HTTP API is unaffected).
cmake_args=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=ON
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF
    -DLLAMA_BUILD_COMMON=ON
    -DLLAMA_BUILD_EXAMPLES=ON
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_LLGUIDANCE=OFF
)
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if grep -sqw amx_tile /proc/cpuinfo; then
    log "this CPU reports AMX: building ggml without its AMX kernels ($NO_AMX)"
    cmake_args+=("-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX")
else
    cmake_args+=("-DCMAKE_C_FLAGS=" "-DCMAKE_CXX_FLAGS=")
fi
STAMP="$BUILD/.edgespec-configure"
want="$(printf '%s\n' "$LLAMA" "${cmake_args[@]}")"
if [[ ! -f "$BUILD/CMakeCache.txt" || ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
    gen=()
    # a generator cannot change in an existing build dir: keep the one it has
    if [[ ! -f "$BUILD/CMakeCache.txt" ]] && command -v ninja >/dev/null 2>&1; then gen=(-G Ninja); fi
    if [[ -f "$BUILD/CMakeCache.txt" ]]; then
        log "reconfiguring $BUILD (configured with other arguments, e.g. without the server)"
    else
        log "configuring $BUILD"
    fi
    cmake -S "$LLAMA" -B "$BUILD" "${gen[@]}" "${cmake_args[@]}" >&2
    printf '%s' "$want" > "$STAMP"
else
    log "already configured: $BUILD"
fi

# 3. build only the named targets -------------------------------------------------------------------
log "building ${targets[*]} with $JOBS jobs (a no-op when up to date)"
cmake --build "$BUILD" --target "${targets[@]}" -j "$JOBS" >&2

for t in "${targets[@]}"; do
    BIN="$BUILD/bin/$t"
    [[ -x "$BIN" ]] || BIN="$(find "$BUILD" -type f -name "$t" -perm -u+x | head -n1)"
    [[ -n "$BIN" && -x "$BIN" ]] || { log "build finished but $t was not found under $BUILD"; exit 1; }
    echo "$BIN"
done
