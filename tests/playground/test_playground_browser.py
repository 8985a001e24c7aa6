"""The playground in real headless chromium: load the page, race plain against n-gram speculation on a tiny
model, and check the coloured tokens, the statistics and the calculator. Saves test-artifacts/playground.png."""
from __future__ import annotations

import re

RACE_TIMEOUT_MS = 30_000
# A tiny random model falls into loops, so the n-gram drafter (prompt_lookup_min = 1) gets drafts accepted.
PROMPT = "abcabcabcabc"


def test_playground_race(playground_server, browser_page, artifacts_dir):
    page = browser_page.page
    page.goto(playground_server.url + "/")
    page.wait_for_selector("body[data-ready='true']", timeout=10_000)
    assert page.input_value("#k") == "4"
    assert [o.strip() for o in page.locator("#method option").all_inner_texts()] == ["ngram (k=4)", "plain (no drafts)"]
    assert "ngram" in page.inner_text("#server-info")

    page.fill("#prompt", PROMPT)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "60")
    page.click("#run")
    page.wait_for_selector("body[data-state='done']", timeout=RACE_TIMEOUT_MS)
    assert page.is_hidden("#error"), page.inner_text("#error")

    spec = page.locator("#lane-spec .output .tok")
    plain = page.locator("#lane-plain .output .tok")
    assert plain.count() == spec.count() == 60
    assert page.locator("#lane-plain .output .tok:not(.tok-target)").count() == 0
    accepted = page.locator("#lane-spec .tok-accepted")
    assert accepted.count() > 0
    assert page.locator("#lane-spec .tok-recovered").count() + page.locator("#lane-spec .tok-bonus").count() > 0
    assert re.fullmatch(r"accepted · draft position \d", accepted.first.get_attribute("title"))
    assert page.inner_text("#lane-spec .output") == page.inner_text("#lane-plain .output")  # greedy is lossless

    for lane in ("#lane-plain", "#lane-spec"):
        assert page.get_attribute(lane, "data-state") == "done"
        assert float(page.inner_text(f"{lane} .tps")) > 0
    alpha = float(page.inner_text("#stat-alpha"))
    assert 0 < alpha <= 1
    assert 0 < float(page.inner_text("#stat-engine-alpha")) <= 1
    assert float(page.inner_text("#stat-tau")) > 1
    assert 1 <= float(page.inner_text("#stat-draft-length")) <= 4
    assert float(page.inner_text("#stat-c")) > 0
    assert page.inner_text("#stat-speedup").endswith("×")

    page.screenshot(path=str(artifacts_dir / "playground.png"), full_page=True)  # with the measured values

    rows = page.locator("#calc-table tbody tr")
    assert rows.count() == 8
    assert page.locator("#calc-table tr.server-k").get_attribute("data-k") == "4"
    assert abs(float(page.input_value("#calc-alpha")) - min(alpha, 0.999)) < 1e-3  # measured α filled in
    page.fill("#calc-alpha", "0.5")
    page.fill("#calc-c", "1")  # c = 1: the speed-up equals E[tokens/step] = (1 - 0.5^(k+1)) / 0.5
    cells = rows.nth(2).locator("td").all_inner_texts()  # k = 3
    assert cells == ["3", "1.88", "1.00", "1.88×"]

    assert browser_page.errors == []


def test_plain_control_one_after_the_other(playground_server, browser_page):
    """Method "plain" sends "speculative": false on both lanes; "one after the other" runs them in turn."""
    page = browser_page.page
    page.goto(playground_server.url + "/")
    page.wait_for_selector("body[data-ready='true']", timeout=10_000)
    page.fill("#prompt", PROMPT)
    page.fill("#max-tokens", "12")
    page.select_option("#endpoint", "completions")
    page.select_option("#method", "plain")
    page.check("#sequential")
    page.click("#run")
    page.wait_for_selector("body[data-state='done']", timeout=RACE_TIMEOUT_MS)
    assert page.is_hidden("#error"), page.inner_text("#error")
    assert page.locator("#lane-spec .output .tok-target").count() == 12
    assert page.locator("#lane-spec .output .tok:not(.tok-target)").count() == 0
    assert page.inner_text("#lane-spec .lane-title") == "Plain decoding (control)"
    assert page.inner_text("#stat-alpha") == "–"
    assert browser_page.errors == []
