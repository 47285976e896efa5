#!/usr/bin/env bash
# Build and install llama-cpp-python (specdec's optional llama.cpp backend) so that
# it runs on *this* CPU.
#
#   scripts/install-llamacpp.sh [--force] [--python PATH] [--server]
#
# llama-cpp-python compiles llama.cpp from source on install (about 5 minutes on two
# cores). Its default build uses -march=native; on some x86-64 machines (VMs whose
# CPUs report AMX, hypervisors that hide features from the OS) that produces a
# library that dies with "Illegal instruction". On x86-64 Linux this script
# therefore turns GGML_NATIVE off and enables exactly the instruction-set
# extensions that /proc/cpuinfo lists (never AMX). On ARM and on macOS the
# default build is used.
#
# On every platform it builds without llamafile's tinyBLAS (-DGGML_LLAMAFILE=OFF):
# tinyBLAS multiplies batches of 2+ tokens with other kernels than single tokens,
# so a batched verification would not give the target's exact one-token logits
# (see specdec/backends/llamacpp.py). Without it, specdec verifies a whole draft
# in one batch and stays exact; with it (LLAMACPP_LLAMAFILE=ON), specdec stays
# exact by verifying one token at a time, which is slower. The multimodal
# library (llava/mtmd) and llama.cpp's `common` library (with its HTTP client),
# which specdec does not use, are not built (scripts/llamacpp-no-common.cmake):
# that is about a third less C++ to compile.
#
# --server also builds llama.cpp's own `llama-server` and `llama-bench` (the peers `specdec bench`
# runs beside specdec: methods llama-server, llama-server-draft, llama-server-ngram) and
# `llama-quantize` (specdec.native.requantize: a model's file requantised to another type, made once
# for the tests) from the very llama.cpp tree that the llama-cpp-python sdist vendors, with the same
# CPU flags, static, into $SPECDEC_HOME/bin (about 10 minutes on two cores, once). Built as a
# llama.cpp user builds them: llamafile's tinyBLAS at llama.cpp's default (on), its `common` library
# included.
#
# Built wheels are cached under $SPECDEC_HOME/wheels (default ~/.cache/specdec/wheels), keyed by
# version, flags, CPU and Python; --force rebuilds.
#
# Environment: PYTHON (default: .venv/bin/python if present, else python3),
# LLAMACPP_VERSION (default 0.3.36), CMAKE_BUILD_PARALLEL_LEVEL (default: nproc),
# LLAMACPP_LLAMAFILE (default OFF), CMAKE_ARGS (appended to the flags chosen here).
set -euo pipefail

version="${LLAMACPP_VERSION:-0.3.36}"
force=0
server=0
python="${PYTHON:-}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --force) force=1 ;;
        --python) python="$2"; shift ;;
        --server) server=1 ;;
        -h|--help) sed -n '2,38p' "$0"; exit 0 ;;
        *) echo "install-llamacpp: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
if [[ -z "$python" ]]; then
    here="$(cd "$(dirname "$0")/.." && pwd)"
    if [[ -x "$here/.venv/bin/python" ]]; then python="$here/.venv/bin/python"; else python=python3; fi
fi

# Already installed, importable, and built the way we want (llamafile off unless asked)?
state="$("$python" - <<'EOF' 2>/dev/null || true
import importlib.metadata as m
try:
    version = m.version("llama_cpp_python")
    import llama_cpp
    info = llama_cpp.llama_print_system_info().decode()
    print(version, "llamafile-on" if "LLAMAFILE = 1" in info else "llamafile-off")
except Exception:
    pass
EOF
)"
want_llamafile="llamafile-off"
if [[ "${LLAMACPP_LLAMAFILE:-OFF}" == ON ]]; then want_llamafile="llamafile-on"; fi
python_done=0
if [[ "$force" == 0 && "$state" == "$version $want_llamafile" ]]; then
    echo "install-llamacpp: llama-cpp-python $version ($want_llamafile) is already installed (use --force to rebuild)"
    python_done=1
fi

arch="$(uname -m)"
os="$(uname -s)"
args=(-DGGML_LLAMAFILE="${LLAMACPP_LLAMAFILE:-OFF}" -DLLAVA_BUILD=OFF)
cpu_args=()  # the instruction-set flags alone (the python build's and the tools' alike)
no_common="$(cd "$(dirname "$0")" && pwd)/llamacpp-no-common.cmake"
if [[ "$no_common" != *" "* ]]; then  # CMAKE_ARGS is split on spaces
    args+=(-DCMAKE_PROJECT_INCLUDE="$no_common")
fi
if [[ "$os" == Linux && ( "$arch" == x86_64 || "$arch" == amd64 || "$arch" == i686 ) && -r /proc/cpuinfo ]]; then
    flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    has() { [[ "$flags" == *" $1 "* ]]; }
    onoff() { if has "$1"; then echo ON; else echo OFF; fi; }
    avx512=OFF
    # ggml's AVX512 option means F + CD + VL + DQ + BW (its -mavx512* set).
    if has avx512f && has avx512cd && has avx512vl && has avx512dq && has avx512bw; then avx512=ON; fi
    cpu_args+=(
        -DGGML_NATIVE=OFF
        -DGGML_SSE42="$(onoff sse4_2)"
        -DGGML_AVX="$(onoff avx)"
        -DGGML_AVX2="$(onoff avx2)"
        -DGGML_FMA="$(onoff fma)"
        -DGGML_F16C="$(onoff f16c)"
        -DGGML_BMI2="$(onoff bmi2)"
        -DGGML_AVX_VNNI="$(onoff avx_vnni)"
        -DGGML_AVX512="$avx512"
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
    )
    if [[ "$avx512" == ON ]]; then
        cpu_args+=(
            -DGGML_AVX512_VBMI="$(onoff avx512vbmi)"
            -DGGML_AVX512_VNNI="$(onoff avx512_vnni)"
            -DGGML_AVX512_BF16="$(onoff avx512_bf16)"
        )
    else
        cpu_args+=(-DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF)
    fi
fi
args+=(${cpu_args[@]+"${cpu_args[@]}"})  # (bash 3.2 under set -u: an empty array is unbound)

if [[ -z "${CMAKE_BUILD_PARALLEL_LEVEL:-}" ]]; then
    CMAKE_BUILD_PARALLEL_LEVEL="$(getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 2)"
fi
export CMAKE_BUILD_PARALLEL_LEVEL
home="${SPECDEC_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/specdec}"
cache="$home/wheels"
user_cmake_args="${CMAKE_ARGS:-}"
export CMAKE_ARGS="${args[*]:-} $user_cmake_args"

install_python() {
    echo "install-llamacpp: building llama-cpp-python $version for $os/$arch" \
         "with $CMAKE_BUILD_PARALLEL_LEVEL jobs; CMAKE_ARGS=$CMAKE_ARGS"
    # Build the wheel first (the installed copy, if any, keeps working meanwhile), then
    # install it over any copy of the same version, then let pip add its dependencies.
    # --no-binary: a prebuilt wheel from some index would not be built for this CPU.
    # A wheel built here is kept in specdec's cache, keyed by everything that went into it
    # (version, flags, CPU flags, Python), so a second install on this machine takes seconds.
    local key wheels wheel
    key="$( { echo "$version $CMAKE_ARGS $arch $os"; "$python" -c 'import sys; print(sys.version)';
              grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true; } | { sha256sum 2>/dev/null || shasum -a 256; } | cut -c1-16)"
    wheels="$(mktemp -d)"
    if [[ "$force" == 0 && -d "$cache/$key" ]] && ls "$cache/$key"/llama_cpp_python-*.whl >/dev/null 2>&1; then
        echo "install-llamacpp: using the wheel built earlier on this machine ($cache/$key)"
        cp "$cache/$key"/llama_cpp_python-*.whl "$wheels/"
    else
        "$python" -m pip wheel --no-cache-dir --no-deps --no-binary llama-cpp-python -w "$wheels" "llama-cpp-python==$version"
        mkdir -p "$cache/$key" && cp "$wheels"/llama_cpp_python-*.whl "$cache/$key/" || true
    fi
    wheel="$(ls "$wheels"/llama_cpp_python-*.whl)"
    "$python" -m pip install --no-cache-dir --no-deps --force-reinstall "$wheel"
    "$python" -m pip install --no-cache-dir "$wheel"
    rm -rf "$wheels"

    # Smoke test: the native library loads and initialises (tests/backends/test_llamacpp.py runs real models).
    "$python" -c "import llama_cpp; llama_cpp.llama_backend_init(); print('install-llamacpp: llama_cpp', llama_cpp.__version__, 'loads;', llama_cpp.llama_print_system_info().decode().strip())"
}

install_tools() {
    # llama-server, llama-bench and llama-quantize from the llama.cpp tree in the llama-cpp-python sdist
    # (the same source as the Python library: one download, one version), into $home/bin; skipped when
    # all three there were built from this version with these flags (build-info.txt says which).
    local bin="$home/bin" info work src tool tools=(llama-server llama-bench llama-quantize) built=1
    info="the llama.cpp tree llama-cpp-python $version vendors; $arch $os; ${cpu_args[*]:-default flags} $user_cmake_args"
    for tool in "${tools[@]}"; do [[ -x "$bin/$tool" ]] || built=0; done
    if [[ "$force" == 0 && "$built" == 1 && "$(cat "$bin/build-info.txt" 2>/dev/null)" == "$info" ]]; then
        echo "install-llamacpp: ${tools[*]} are already built in $bin (use --force to rebuild)"
        return
    fi
    if ! command -v cmake >/dev/null; then
        echo "install-llamacpp: --server needs cmake on PATH (apt install cmake, or pip install cmake)" >&2; exit 1
    fi
    work="$(mktemp -d)"
    echo "install-llamacpp: building ${tools[*]} ($info) with $CMAKE_BUILD_PARALLEL_LEVEL jobs"
    "$python" -m pip download --no-cache-dir --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version" >/dev/null
    tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
    src="$(ls -d "$work"/llama_cpp_python-*/vendor/llama.cpp)"
    # shellcheck disable=SC2086  # the user's CMAKE_ARGS are split on spaces, as CMake's own reader does
    cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_OPENSSL=OFF ${cpu_args[@]+"${cpu_args[@]}"} $user_cmake_args >"$work/cmake.log" 2>&1 \
        || { tail -20 "$work/cmake.log" >&2; echo "install-llamacpp: configuring llama.cpp failed (log above)" >&2; exit 1; }
    # (llama-quantize is tools/quantize's target, built with LLAMA_BUILD_TOOLS as the server is)
    cmake --build "$work/build" --config Release -j "$CMAKE_BUILD_PARALLEL_LEVEL" --target "${tools[@]}" \
        >"$work/build.log" 2>&1 \
        || { tail -20 "$work/build.log" >&2; echo "install-llamacpp: building ${tools[*]} failed (log above)" >&2; exit 1; }
    mkdir -p "$bin"
    for tool in "${tools[@]}"; do cp "$work/build/bin/$tool" "$bin/"; done
    echo "$info" >"$bin/build-info.txt"
    rm -rf "$work"
    "$bin/llama-server" --version 2>&1 | sed -n '1,2p' | sed 's/^/install-llamacpp: llama-server: /'
    echo "install-llamacpp: ${tools[*]} are in $bin"
}

if [[ "$python_done" == 0 ]]; then install_python; fi
if [[ "$server" == 1 ]]; then install_tools; fi
