from __future__ import annotations

import pytest

from specdec.config import SamplingParams, SpeculativeConfig


def test_sampling_defaults_are_greedy() -> None:
    params = SamplingParams()
    assert params.greedy
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, r"temperature must be >= 0 \(0 = greedy\), got -0.1"),
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -1}, "top_k must be >= 0, got -1"),
        ({"top_k": 2.5}, "top_k must be an int, got float 2.5"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"seed": "7"}, "seed must be an int, got str"),
        ({"stop": "END"}, "stop must be a tuple of non-empty strings"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got int"),
    ],
)
def test_sampling_params_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_speculative_defaults_and_round_trip() -> None:
    config = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 5}')
    assert (config.prompt_lookup_max, config.prompt_lookup_min) == (4, 2)
    assert (config.suffix_max_depth, config.suffix_min_token_prob, config.suffix_cache_requests) == (64, 0.1, 64)
    assert SpeculativeConfig.from_dict(config.to_dict()) == config
    draft = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model="Qwen/Qwen2.5-0.5B")
    assert draft.to_dict()["model"] == "Qwen/Qwen2.5-0.5B"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"method": "lookahead", "num_speculative_tokens": 2},
         "unknown speculative method 'lookahead'; known methods: ngram, suffix, draft_model, eagle, medusa"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1, got 0"),
        ({"method": "ngram", "num_speculative_tokens": 33}, "num_speculative_tokens must be <= 32, got 33"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens must be an int, got str"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be an int, got bool"),
        ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
         r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(3\)"),
        ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 0}, "prompt_lookup_min must be >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 4, "lookup_max": 3},
         "unknown speculative config key\\(s\\): 'lookup_max'; valid keys: method, num_speculative_tokens, model, "
         "prompt_lookup_max, prompt_lookup_min, suffix_max_depth, suffix_min_token_prob, suffix_cache_requests, "
         "num_draft_branches, draft_tree_min_prob, draft_prefix_cache_tokens, draft_vocab_size"),
        ({"method": "draft_model", "num_speculative_tokens": 4},
         "speculative method 'draft_model' needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 4, "model": "tiny"},
         "speculative method 'ngram' uses no draft model, but 'model' was given: 'tiny'"),
        ({"method": "suffix", "num_speculative_tokens": 4, "model": "tiny"},
         "speculative method 'suffix' uses no draft model"),
        ({"method": "suffix", "num_speculative_tokens": 4, "suffix_min_token_prob": 1.5},
         r"suffix_min_token_prob must be in \[0, 1\], got 1.5"),
        ({"method": "suffix", "num_speculative_tokens": 4, "suffix_max_depth": 0}, "suffix_max_depth must be >= 1"),
        ({"method": "suffix", "num_speculative_tokens": 4, "suffix_cache_requests": -1},
         "suffix_cache_requests must be >= 0"),
        ({"method": "ngram", "num_speculative_tokens": 4, "num_draft_branches": 0}, "num_draft_branches must be >= 1"),
        ({"method": "suffix", "num_speculative_tokens": 4, "num_draft_branches": 9}, "num_draft_branches must be <= 8"),
        ({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 4, "draft_tree_min_prob": -0.1},
         r"draft_tree_min_prob must be in \[0, 1\], got -0.1"),
        ({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 4, "draft_prefix_cache_tokens": -1},
         "draft_prefix_cache_tokens must be >= 0, got -1"),
        ({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 4, "draft_vocab_size": 0},
         "draft_vocab_size must be >= 1, got 0"),
        ({"method": "ngram", "num_speculative_tokens": 4, "draft_vocab_size": 1000},
         "draft_vocab_size applies to method 'draft_model' only, not 'ngram'"),
        ({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 4, "draft_prefix_cache_tokens": 1.5},
         "draft_prefix_cache_tokens must be an int, got float"),
        ({"method": "ngram"}, "missing required key\\(s\\): num_speculative_tokens"),
        ({"method": 3, "num_speculative_tokens": 4}, "method must be a string, got int"),
    ],
)
def test_speculative_config_errors(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(data)


def test_malformed_json_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="malformed speculative config JSON: Expecting"):
        SpeculativeConfig.from_json('{"method": "ngram",')


def test_json_must_be_an_object() -> None:
    with pytest.raises(ValueError, match="must be a JSON object / dict, got list"):
        SpeculativeConfig.from_json('["ngram"]')


def test_tree_width_defaults_per_method():
    """Weighed dynamic trees by default for draft_model and eagle (the adaptive policy cuts them to what pays),
    chains for the lookups; an explicit value wins, and medusa's chains-only default passes validation."""
    width = lambda method, **extra: SpeculativeConfig.from_dict(  # noqa: E731
        {
            "method": method,
            "num_speculative_tokens": 4,
            **({"model": "m"} if method in ("draft_model", "eagle", "medusa") else {}),
            **extra,
        }
    ).num_draft_branches
    assert [width(m) for m in ("ngram", "suffix", "draft_model", "eagle", "medusa")] == [1, 1, 4, 4, 1]
    assert width("draft_model", num_draft_branches=1) == 1 and width("ngram", num_draft_branches=3) == 3
