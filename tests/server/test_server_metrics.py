"""/metrics parses with prometheus_client's text parser; spec-decode counters (vLLM names) move after
speculative requests and stay put for `"speculative": false`; latency histograms count requests."""
import httpx

from server_helpers import MODEL

SPEC_COUNTERS = ["specdec:spec_decode_num_drafts_total", "specdec:spec_decode_num_draft_tokens_total",
                 "specdec:spec_decode_num_accepted_tokens_total"]
GAUGES = ["specdec:num_requests_running", "specdec:num_requests_waiting", "specdec:kv_cache_free_slots",
          "specdec:kv_cache_total_slots", "process_resident_memory_bytes"]


def complete(url: str, speculative: bool) -> None:
    body = {"model": MODEL, "prompt": "abcabcabcabcabc", "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "speculative": speculative}
    httpx.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()


def test_metrics_parse_and_spec_counters_move(ngram_server):
    before = ngram_server.metrics()
    assert all(name in before for name in SPEC_COUNTERS + GAUGES)
    assert before["specdec:kv_cache_total_slots"] == 4 and before["process_resident_memory_bytes"] > 10**6
    complete(ngram_server.url, speculative=False)
    plain = ngram_server.metrics()
    assert all(plain[name] == before[name] for name in SPEC_COUNTERS)
    complete(ngram_server.url, speculative=True)
    after = ngram_server.metrics()
    assert after["specdec:spec_decode_num_drafts_total"] > plain["specdec:spec_decode_num_drafts_total"]
    assert after["specdec:spec_decode_num_draft_tokens_total"] >= after["specdec:spec_decode_num_drafts_total"]
    accepted = after["specdec:spec_decode_num_accepted_tokens_total"]
    assert accepted > plain["specdec:spec_decode_num_accepted_tokens_total"]  # the repetitive prompt gets accepted
    per_position = [
        v for k, v in after.items() if k.startswith("specdec:spec_decode_num_accepted_tokens_per_pos_total")
    ]
    assert 'specdec:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in after
    assert sum(per_position) == accepted
    for histogram in ["time_to_first_token_seconds", "e2e_request_latency_seconds"]:
        assert after[f"specdec:{histogram}_count"] == before[f"specdec:{histogram}_count"] + 2
        assert after[f'specdec:{histogram}_bucket{{le="+Inf"}}'] == after[f"specdec:{histogram}_count"]
    assert (
        after["specdec:inter_token_latency_seconds_count"]
        == before["specdec:inter_token_latency_seconds_count"] + 2 * 31
    )
    assert after["specdec:generation_tokens_total"] == before["specdec:generation_tokens_total"] + 64


def test_status_endpoint(ngram_server):
    status = ngram_server.wait_idle()
    assert status["model"] == MODEL and status["engine_alive"]
    assert status["kv_cache_free_slots"] == status["kv_cache_total_slots"] == 4
    assert status["spec_decode"]["verify_steps"] >= 0
