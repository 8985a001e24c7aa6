"""Access to the embedded real models in tests (CI pulls them first; a missing file fails, never skips)."""
from __future__ import annotations

from pathlib import Path

import pytest

from specdec.models.catalog import models_dir


def real_model_path(name: str) -> Path:
    path = models_dir() / f"{name}.gguf"
    if not path.is_file():
        pytest.fail(f"missing {path}: run `specdec pull {name}`")
    return path
