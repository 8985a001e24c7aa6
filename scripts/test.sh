#!/usr/bin/env bash
# The test command: sets up (idempotent) and runs the whole test suite, real-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check src tests  # the linter (pyproject.toml [tool.ruff])
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
