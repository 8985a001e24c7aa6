"""Drafter construction: method dispatch and the draft-model checks that run before any work."""
import json

import pytest

from specdec.config import SpeculativeConfig
from specdec.drafters import factory
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.models.tokenizer import Tokenizer
from tiny_models import write_tiny_tokenizer


def build(config_dict, target, tokenizer):
    return factory.build_drafter(SpeculativeConfig.from_dict(config_dict), target, tokenizer, max_model_len=128,
                                 max_num_seqs=2)


def test_methods_build_their_drafters(make_tiny_model, tiny_tokenizer, monkeypatch):
    target = make_tiny_model("llama")
    assert isinstance(build({"method": "ngram", "num_speculative_tokens": 3}, target, tiny_tokenizer), NgramDrafter)
    assert isinstance(build({"method": "suffix", "num_speculative_tokens": 3}, target, tiny_tokenizer), SuffixDrafter)
    monkeypatch.setattr("specdec.runtime.load_model",
                        lambda name, fmt, device: (make_tiny_model("llama", seed=1, num_layers=1), tiny_tokenizer))
    drafter = build({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}, target, tiny_tokenizer)
    assert isinstance(drafter, DraftModelDrafter)


def test_draft_model_format_defaults_to_q4_all_whatever_the_target(make_tiny_model, tiny_tokenizer, monkeypatch):
    target = make_tiny_model("llama")  # q8
    formats = []

    def load(name, weight_format, device):
        formats.append(weight_format)
        return make_tiny_model("llama", seed=1, num_layers=1), tiny_tokenizer

    monkeypatch.setattr("specdec.runtime.load_model", load)
    build({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}, target, tiny_tokenizer)
    build({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3, "weight_format": "auto"}, target,
          tiny_tokenizer)
    assert formats == ["q4-all", "auto"]


def test_draft_model_with_other_vocabulary_is_rejected_naming_the_ids(
    make_tiny_model, tiny_tokenizer, tmp_path, monkeypatch
):
    directory = write_tiny_tokenizer(tmp_path / "other")
    data = json.loads((directory / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    swapped = {token: (71 if i == 72 else 72 if i == 71 else i) for token, i in vocab.items()}
    data["model"]["vocab"] = swapped
    (directory / "tokenizer.json").write_text(json.dumps(data))
    other_tokenizer = Tokenizer.from_hf_dir(directory)
    monkeypatch.setattr(
        "specdec.runtime.load_model", lambda name, fmt, device: (make_tiny_model("llama", seed=1), other_tokenizer)
    )
    with pytest.raises(ValueError, match=r"2 ids differ.*71: target"):
        build(
            {"method": "draft_model", "model": "other", "num_speculative_tokens": 3},
            make_tiny_model("llama"),
            tiny_tokenizer,
        )


def test_draft_model_with_other_vocabulary_size_is_rejected(make_tiny_model, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr("specdec.runtime.load_model",
                        lambda name, fmt, device: (make_tiny_model("llama", seed=1, vocab_size=280), tiny_tokenizer))
    with pytest.raises(ValueError, match="280 entries, the target's 300"):
        build(
            {"method": "draft_model", "model": "small", "num_speculative_tokens": 3},
            make_tiny_model("llama"),
            tiny_tokenizer,
        )


def test_draft_model_larger_than_target_warns(make_tiny_model, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr("specdec.runtime.load_model",
                        lambda name, fmt, device: (make_tiny_model("llama", seed=1, num_layers=6), tiny_tokenizer))
    with pytest.warns(UserWarning, match="is not smaller than the target"):
        build(
            {"method": "draft_model", "model": "big", "num_speculative_tokens": 3},
            make_tiny_model("llama"),
            tiny_tokenizer,
        )


def test_draft_vocab_size_keeps_the_first_ids_and_the_end_tokens(make_tiny_model, tiny_tokenizer, monkeypatch):
    target = make_tiny_model("llama")
    monkeypatch.setattr("specdec.runtime.load_model",
                        lambda name, fmt, device: (make_tiny_model("llama", seed=1, num_layers=1), tiny_tokenizer))
    config = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3, "draft_vocab_size": 100}
    drafter = build(config, target, tiny_tokenizer)
    assert drafter.draft_token_ids.tolist() == sorted({*range(100), *tiny_tokenizer.eos_token_ids})
    with pytest.raises(ValueError, match=r"draft_vocab_size 301 exceeds the draft model's vocabulary \(300\)"):
        build({**config, "draft_vocab_size": 301}, target, tiny_tokenizer)
