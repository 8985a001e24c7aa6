"""The batch sweep on a tiny model: every configuration is lossless at every batch size, the fixed-k
configuration keeps drafting at batch 8 while the batch-aware one stops, and the plot is written."""
from specdec.bench import batch_sweep

REPEATING_PROMPTS = [[5, 17, 42, 5, 17, 42, 5, 17], [99, 3, 250, 77, 12, 99, 3, 250, 77],
                     [7, 180, 91, 7, 180, 91, 7], [33, 34, 35, 33, 34, 35, 33]]


def test_sweep_is_lossless_and_only_the_batch_rule_stops_drafting(make_tiny_model, tiny_tokenizer, tmp_path):
    model = make_tiny_model("llama")
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llms = batch_sweep.build_llms((model, tiny_tokenizer), config, max_batch=8, max_verify_tokens=8)
    prompts = (REPEATING_PROMPTS * 2)[:8]
    points = batch_sweep.sweep(llms, prompts, [1, 8], max_new_tokens=12, repeats=1)
    assert [(p.batch_size, p.config) for p in points] == [(b, c) for b in (1, 8) for c in batch_sweep.CONFIGS]
    assert all(p.identical for p in points)
    by_key = {(p.batch_size, p.config): p for p in points}
    assert by_key[(8, "fixed")].mean_accepted_length > 1.0  # drafts and gets some accepted at batch 8
    assert by_key[(8, "batch-aware")].mean_accepted_length is None  # 8 rows already fill the budget: no drafts
    assert by_key[(1, "plain")].speedup == 1.0
    batch_sweep.plot(points, tmp_path / "sweep.png", "tiny")
    assert (tmp_path / "sweep.png").stat().st_size > 1000
