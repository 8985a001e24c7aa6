"""The soak (specdec.bench.soak) for a few seconds against a tiny-model server with an API key: every kind of
request is sent, nothing is lost, malformed or failed, every KV slot is free at the end; and its checks do catch
broken answers."""
import json

import httpx
import pytest

from server_helpers import NGRAM_CONFIG, start_server, tiny_llm
from specdec.bench import soak
from specdec.server.app import ServerConfig
from specdec.server.protocol import RequestLimits

BODY_LIMIT = 4096


def test_a_short_soak_loses_nothing_and_frees_every_slot(make_tiny_model, tiny_tokenizer, tmp_path, capsys):
    llm = tiny_llm(make_tiny_model, tiny_tokenizer, NGRAM_CONFIG)
    llm.generate([[1, 2, 3]])  # warm-up (kernel build)
    server = start_server(llm, ServerConfig(api_key="key", limits=RequestLimits(max_body_bytes=BODY_LIMIT)))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"abc abc abc {i} abc"]})
                                 for i in range(6)))
    output = tmp_path / "soak.json"
    try:
        code = soak.main(["--url", server.url, "--api-key", "key", "--minutes", "0.05", "--concurrency", "8",
                          "--max-tokens", "12", "--max-request-bytes", str(BODY_LIMIT), "--prompts", str(prompts),
                          "--rss-interval", "0.5", "--output", str(output)])
    finally:
        server.stop()
    report = json.loads(output.read_text())
    assert code == 0 and report["passed"], report["problem_samples"]
    assert report["lost"] == report["malformed"] == report["failed"] == 0
    assert set(report["by_kind"]) == set(soak.MIX)
    assert all(row["requests"] > 0 and row["ok"] == row["requests"] for row in report["by_kind"].values())
    assert sum(row["left"] for row in report["by_kind"].values()) > 0
    assert report["slots_free"] and report["end"]["kv_cache_free_slots"] == report["end"]["kv_cache_total_slots"] == 4
    assert report["tok_s"] > 0 and report["per_minute"][0]["completed_generations"] > 0
    assert report["rss_first_minute_median_mb"] > 1 and report["rss_samples"]
    assert report["speculation"]["drafted_tokens"] > 0  # the tiny server's fixed k drafts at every step
    assert "PASSED" in capsys.readouterr().out


def chunk(text: str, token_ids: list[int], finish_reason=None) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "token_ids": token_ids}]}


def usage(completion: int) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": completion, "total_tokens": 3 + completion}}


def feed(chunks: list[dict | None]) -> int:
    check = soak.StreamCheck(soak.KINDS["completion_stream"], max_tokens=8)
    for item in chunks:
        check.add(item)
    return check.finish()


def test_the_stream_check_catches_broken_streams():
    assert feed([chunk("a", [5]), chunk("b", [6], "stop"), usage(2), None]) == 2
    with pytest.raises(soak.Malformed, match="completion_tokens 3 but 2"):
        feed([chunk("a", [5]), chunk("b", [6], "stop"), usage(3), None])
    with pytest.raises(soak.Malformed, match="after the one with finish_reason"):
        feed([chunk("a", [5], "stop"), chunk("b", [6]), usage(2), None])
    with pytest.raises(soak.Malformed, match="ids differ"):
        feed([chunk("a", [5]), {**chunk("b", [6], "stop"), "id": "cmpl-2"}, usage(2), None])
    with pytest.raises(httpx.RemoteProtocolError, match="without \\[DONE\\]"):  # counted as lost
        feed([chunk("a", [5]), chunk("b", [6], "stop"), usage(2)])
    error = {"error": {"message": "the engine failed", "type": "internal_server_error", "param": None, "code": None}}
    with pytest.raises(soak.Failed, match="in-band error"):
        feed([chunk("a", [5]), error, None])
    with pytest.raises(soak.Malformed, match="error keys"):
        soak.check_error_body({"error": {"message": "x"}})
