"""The docs are reference: every relative link resolves, the plots come from their committed figures, and
nothing in the project speaks of work sessions."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_relative_links_resolve(doc):
    for target, _anchor in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        assert (doc.parent / target).exists(), f"{doc.name} links {target}, which does not exist"


def test_plots_are_drawn_from_committed_figures():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_docs.py"), "--check"], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_work_log_wording():
    files = [*DOCS, *(ROOT / "src").rglob("*.py"), *(ROOT / "src").rglob("*.h"), *(ROOT / "src").rglob("*.cpp"),
             *(ROOT / "scripts").rglob("*.py"), *(ROOT / "scripts").rglob("*.sh")]
    # pytest's fixture scope "session" is its API, not a work log: the tests are not scanned.
    offenders = [f"{path.relative_to(ROOT)}:{number}" for path in files
                 for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1)
                 if re.search(r"\bsessions?\b", line, re.IGNORECASE)]
    assert not offenders, offenders
