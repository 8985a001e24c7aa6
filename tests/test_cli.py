"""`specdec generate` end to end on a tiny checkpoint directory: the options reach the engine."""
import pytest
import torch

import specdec.engine.engine as engine_module
from specdec.cache.kv_cache import KVCache
from specdec.cli import main


@pytest.fixture
def cache_dtypes(monkeypatch):
    """The dtypes of the KV caches the engine builds during a command."""
    seen = []

    class RecordingCache(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self.dtype)

    monkeypatch.setattr(engine_module, "KVCache", RecordingCache)
    return seen


@pytest.mark.parametrize("option,expected", [([], torch.float16), (["--kv-cache-dtype", "float32"], torch.float32),
                                             (["--weight-format", "fp32"], torch.float32)])
def test_generate_builds_the_kv_cache_the_options_ask_for(tiny_model_dir, cache_dtypes, capsys, option, expected):
    argv = ["generate", "--model", str(tiny_model_dir), "--max-tokens", "6", "--threads", "2", *option,
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--compare-plain",
            "--draft-policy", "fixed", "abcabcabc"]  # fixed: no cost profile of the tiny model measured and cached
    assert main(argv) == 0
    assert cache_dtypes == [expected]
    assert "tok/s" in capsys.readouterr().err


def test_generate_rejects_an_unknown_kv_cache_dtype(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(tiny_model_dir), "--kv-cache-dtype", "bf16", "hi"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'bf16'" in capsys.readouterr().err
