"""Imports point one way: models -> cache -> drafters -> engine -> server / bench / train (plus the kernels and
the shared leaf modules below them). A module may import its own layer and the layers below, never above."""
import ast
from pathlib import Path

import specdec

PACKAGE = Path(specdec.__file__).parent
# each layer with the layers it must not import
FORBIDDEN = {
    "kernels": ("models", "cache", "drafters", "heads", "engine", "server", "bench", "train"),
    "models": ("cache", "drafters", "heads", "engine", "server", "bench", "train"),
    "cache": ("drafters", "heads", "engine", "server", "bench", "train"),
    "heads": ("engine", "server", "bench", "train"),
    "drafters": ("engine", "server", "bench", "train"),
    "verify": ("engine", "server", "bench", "train"),
    "engine": ("server", "bench", "train"),
    "server": ("bench", "train"),
    "train": ("bench", "server"),
    "plan": ("bench", "server", "train"),
    "datasets": ("engine", "server", "bench", "train"),
}


def _type_checking_blocks(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (imports for annotations only, never executed)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            inside.update(id(child) for statement in node.body for child in ast.walk(statement))
    return inside


def _imports(path: Path) -> set[str]:
    """The specdec subpackages or modules a file imports at run time."""
    names = set()
    tree = ast.parse(path.read_text())
    annotations_only = _type_checking_blocks(tree)
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdec."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("specdec."))
    return names


def test_imports_point_one_way():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for target in sorted(_imports(path) & set(FORBIDDEN.get(layer, ()))):
            violations.append(f"{path.relative_to(PACKAGE)} imports specdec.{target}")
    assert not violations, "\n".join(violations)


def test_the_check_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from typing import TYPE_CHECKING\nfrom specdec.engine.engine import Engine\n"
                   "import specdec.bench.runner\nif TYPE_CHECKING:\n    from specdec.server import app\n")
    assert _imports(bad) == {"engine", "bench"}
