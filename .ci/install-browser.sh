#!/usr/bin/env bash
# Installs Debian's chromium for the playground's browser tests (tests/playground/), unless it is there.
# Idempotent; needs root (CI runs as root). The tests drive /usr/bin/chromium through the `playwright`
# Python package; never run `playwright install` (it downloads a browser build of its own).
set -euo pipefail
CHROMIUM=/usr/bin/chromium  # the path tests/playground/conftest.py launches
if [ -x "$CHROMIUM" ] && [ -d /usr/share/fonts/truetype/dejavu ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium fonts-dejavu-core > /dev/null  # a font, so screenshots show text
"$CHROMIUM" --version >&2
