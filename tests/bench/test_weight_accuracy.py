"""The weight-accuracy benchmark's measures, and a run on a tiny model."""
import json
import math

import torch

from specdec.bench.weight_accuracy import FormatAccuracy, accumulate, main


def test_kl_top1_and_perplexity_against_hand_computed_values():
    reference = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))  # [2 positions, 3 tokens]
    other = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.1, 0.8, 0.1]]))
    result = FormatAccuracy("other")
    accumulate(result, reference, other, token_ids=[7, 1])  # the text: token 1 follows position 0
    expected_kl = (0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5)) / 2
    assert math.isclose(result.mean_kl, expected_kl, rel_tol=1e-6)
    assert result.top1 == 0.5  # position 0's argmax differs, position 1's agrees
    assert math.isclose(result.perplexity, 2.0, rel_tol=1e-6)  # -log 0.5 on the one scored position
    same = FormatAccuracy("same")
    accumulate(same, reference, reference, token_ids=[7, 1])
    assert same.mean_kl == 0.0 and same.top1 == 1.0


def test_run_on_a_tiny_model(tiny_model_dir, tmp_path):
    dataset = tmp_path / "questions.jsonl"
    dataset.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"question number {i} " * 4]})
                               + "\n" for i in range(8)))
    out = tmp_path / "accuracy.json"
    assert main(["--model", str(tiny_model_dir), "--dataset", str(dataset), "--texts", "2", "--max-tokens", "24",
                 "--formats", "q8,auto", "--out", str(out)]) == 0
    results = {row["name"]: row for row in json.loads(out.read_text())["results"]}
    assert results["fp32 (reference)"]["mean_kl"] == 0.0
    assert 0.0 < results["q8"]["mean_kl"] < 0.05  # int8 is close to fp32, and not identical
    assert results["auto"]["mean_kl"] == results["q8"]["mean_kl"]  # an fp32 HF directory: auto is q8
