"""The playground's fixtures: a tiny-model server with an n-gram drafter, and Debian's headless chromium.

The browser is /usr/bin/chromium (`.ci/install-browser.sh` installs it) driven by the `playwright` package;
no browser is ever downloaded. A missing chromium FAILS the browser tests, it never skips them.
"""
from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))  # share the server tests' helpers
from server_helpers import ngram_tiny_server  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


@pytest.fixture(scope="session")
def playground_server(make_tiny_model, tiny_tokenizer):
    with ngram_tiny_server(make_tiny_model, tiny_tokenizer) as running:
        yield running


@pytest.fixture
def artifacts_dir() -> Path:
    """test-artifacts/ in the repository root (git-ignored): screenshots for people to look at."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@dataclass
class BrowserPage:
    page: object  # playwright.sync_api.Page
    errors: list[str] = field(default_factory=list)  # uncaught exceptions and console errors of the page


@pytest.fixture
def browser_page(tmp_path) -> BrowserPage:
    """A page in a fresh headless chromium profile (tmp_path), with the page's JS errors collected."""
    if not (CHROMIUM.is_file() and shutil.which(str(CHROMIUM))):
        pytest.fail(f"{CHROMIUM} is missing: the playground tests need Debian's chromium; "
                    "install it with `bash .ci/install-browser.sh` (as root)", pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 1000})
        browser = BrowserPage(context.new_page())
        browser.page.on("pageerror", lambda error: browser.errors.append(str(error)))
        browser.page.on("console", lambda message: message.type == "error" and browser.errors.append(message.text))
        try:
            yield browser
        finally:
            context.close()
