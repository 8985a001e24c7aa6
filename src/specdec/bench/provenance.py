"""Where a benchmark's figures come from: the CPU's name and the run's common metadata (no torch at import, so
the soak test can name the CPU before it loads anything)."""
from __future__ import annotations

import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    """lscpu's model name; /proc/cpuinfo's, or platform.processor(), where lscpu is missing."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    if not text and Path("/proc/cpuinfo").exists():
        text = Path("/proc/cpuinfo").read_text()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or "unknown"


def run_metadata(threads: int, kernels: dict[str, Any], argv: list[str] | None) -> dict[str, Any]:
    """The fields every results document carries: threads, CPU, torch version, commit, command line, start time and
    the kernel report (`kernels.report.announce_kernels(...).to_dict()`)."""
    import torch

    from specdec.bench.runner import _git_commit

    return {"threads": threads, "cpu": cpu_name(), "torch_version": torch.__version__, "git_commit": _git_commit(),
            "command_line": list(argv) if argv is not None else sys.argv,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **kernels}
