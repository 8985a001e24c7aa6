"""scripts/probes/kernel_build_ab.py: two kernel builds timed side by side, their bits compared."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specdec.kernels import ops

PROBE = Path(__file__).resolve().parents[2] / "scripts" / "probes" / "kernel_build_ab.py"

pytestmark = pytest.mark.skipif(not ops.kernels_available(), reason="the compiled kernels are not built here")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("fmt", ["q5", "q8"])
def test_one_build_against_itself_gives_a_row_per_row_count(fmt):
    build = ops._load().__file__
    isa = "avx2" if "avx2" in ops._load().supported_isas() else "scalar"
    done = _run(build, build, "--format", fmt, "--isa", isa, "--shapes", "96x36,640x8", "--rows", "1,5,9",
                "--calls", "2")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| rows")]
    assert [line.split(" | ")[0] for line in rows] == ["| 1", "| 5", "| 9"] * 2, done.stdout


def test_an_unknown_format_is_refused():
    build = ops._load().__file__
    done = _run(build, build, "--format", "q3")
    assert done.returncode != 0 and "--format 'q3'" in done.stderr
