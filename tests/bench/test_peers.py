"""Peer plumbing that needs no peer package: draft accounting, vLLM's environment, clear refusals."""
import numpy as np
import pytest

from specdec.bench.peers import DraftRecorder, LlamaCppPeer, PeerContext, PeerUnavailable, make_peer, vllm_environment


class FixedDrafts:
    """A stand-in llama-cpp-python draft model: proposes the given drafts in turn."""

    def __init__(self, drafts):
        self.drafts = list(drafts)

    def __call__(self, input_ids, /, **kwargs):
        return np.array(self.drafts.pop(0), dtype=np.intc)


def test_draft_recorder_counts_each_draft_up_to_its_first_wrong_token():
    prompt = [7, 8, 9]
    generated = [1, 2, 3, 4, 5, 6]
    recorder = DraftRecorder(FixedDrafts([[2, 3, 9], [], [5, 6, 7]]))
    recorder(np.array(prompt + generated[:1]))  # after token 1: drafts 2 3 9 -> 2 accepted
    recorder(np.array(prompt + generated[:3]))  # no match: not a drafting step
    recorder(np.array(prompt + generated[:4]))  # drafts 5 6 7 past the end: judged on 5 6 only
    counters = recorder.counters(prompt + generated, num_pred_tokens=3)
    assert counters == {"verify_steps": 2, "drafted_tokens": 5, "accepted_tokens": 4,
                        "drafted_per_position": [2, 2, 1], "accepted_per_position": [2, 2, 0]}


def test_vllm_environment_binds_the_benchmark_threads_and_keeps_what_the_user_set(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    environment = vllm_environment(threads=2)
    assert environment["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert environment["OMP_NUM_THREADS"] == "2"
    assert environment["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_llama_cpp_peer_needs_a_gguf_file(tmp_path):
    context = PeerContext(model="dir", model_path=tmp_path, draft_path=None, methods=[], eos_token_ids=(1,),
                          threads=1, max_model_len=64)
    with pytest.raises(PeerUnavailable, match="needs a .gguf model"):
        LlamaCppPeer().build_runners(context)


def test_unknown_peer_is_refused():
    with pytest.raises(ValueError, match="unknown peer 'sglang'; known peers: transformers, llama-cpp, vllm"):
        make_peer("sglang")
