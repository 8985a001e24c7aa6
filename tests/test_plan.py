"""`specdec plan`: the formulas against hand-computed cases, and the command on a tiny HF checkpoint."""
import pytest

from specdec import plan
from specdec.cli import main
from tiny_models import tiny_config, write_tiny_tokenizer


def test_tokens_per_step():
    assert plan.tokens_per_step(0.8, 4) == pytest.approx(3.3616)
    assert plan.tokens_per_step(0.0, 7) == 1.0
    assert plan.tokens_per_step(1.0, 3) == 4.0


def test_ridge_points():
    assert plan.HARDWARE["h100"].ridge_point("bf16") == pytest.approx(989 / 3.35)  # 295.2 FLOP/B
    assert plan.HARDWARE["h200"].ridge_point("bf16") == pytest.approx(989 / 4.8)  # 206.0
    assert plan.HARDWARE["a100"].ridge_point("bf16") == pytest.approx(156.0)
    assert plan.HARDWARE["h100"].ridge_point("int8") == pytest.approx(2 * 989 / 3.35)
    # rows where a GEMM turns compute-bound: ridge · bytes per weight / 2 — the same 295 rows in bf16 and int8
    assert plan.gemm_rows_at_ridge(plan.HARDWARE["h100"].ridge_point("bf16"), 2) == pytest.approx(295.22, abs=0.01)
    assert plan.gemm_rows_at_ridge(plan.HARDWARE["h100"].ridge_point("int8"), 1) == pytest.approx(295.22, abs=0.01)
    assert plan.gemm_intensity(8, 1) == 16.0


def test_attention_intensity():
    # G = 8 query heads per KV head, D = 5 verified tokens, bf16 cache: 2·8·5/2 = 40 FLOP per byte
    assert plan.attention_intensity(8, 5, 2) == 40.0
    assert plan.attention_intensity(8, 1, 2) * 5 == plan.attention_intensity(8, 5, 2)  # D multiplies it


def test_expected_experts():
    assert plan.expected_experts(1, 2, 8) == pytest.approx(2.0)
    assert plan.expected_experts(4, 2, 8) == pytest.approx(8 * (1 - 0.75**4))  # 5.46875
    assert plan.expected_experts(1000, 2, 8) == pytest.approx(8.0)


def test_parse_hardware():
    assert plan.parse_hardware("H100").name == "H100 SXM"
    assert plan.parse_hardware("this-machine") is None
    custom = plan.parse_hardware("bw=2T,flops=500T")
    assert (custom.bandwidth, custom.bf16_flops) == (2e12, 500e12)
    with pytest.raises(ValueError, match="--hardware"):
        plan.parse_hardware("tpu")


def test_analyse_flat_and_compute_bound():
    config = tiny_config("qwen2")
    flat = plan.analyse(config, lambda tokens: 1.0, ridge=300, dtype="int8", kv_bytes=2, batch=1, alpha=0.8, max_k=8)
    assert flat.rows[4].tokens_per_step == pytest.approx(3.3616) and flat.rows[4].speedup == pytest.approx(3.3616)
    assert flat.recommended_k > 4
    bound = plan.analyse(
        config, lambda tokens: float(tokens), ridge=300, dtype="int8", kv_bytes=2, batch=1, alpha=0.8, max_k=8
    )
    assert bound.recommended_k == 0
    assert any("dense model" in reason for reason in bound.reasons)


def test_roofline_is_flat_at_batch_1_and_rises_past_the_ridge():
    stats = plan.ModelStats.of(tiny_config("llama", hidden_size=4096, intermediate_size=14336, num_layers=32,
                                           num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256))
    h100 = plan.HARDWARE["h100"]
    t = lambda batch, tokens, context=1024: plan.roofline_seconds(stats, h100, "bf16", batch, tokens, context, 2)  # noqa: E731
    assert t(1, 5) == pytest.approx(t(1, 1))  # memory-bound: 5 rows cost one weight stream
    assert t(1, 1) == pytest.approx((stats.streamed_params * 2 + 32 * 1024 * 2 * 8 * 128 * 2) / 3.35e12)
    assert t(128, 5, 16) > 1.5 * t(128, 1, 16)  # 640 rows at a short context: past the ridge
    assert t(128, 5) < 1.2 * t(128, 1)  # at 1024 tokens of context, 128 sequences' KV reads dominate


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    import transformers  # test dependency
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    hf_config = transformers.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    transformers.Qwen2ForCausalLM(hf_config).save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return directory


def test_plan_cli_named_hardware_writes_png(tiny_hf_dir, tmp_path, capsys):
    out = tmp_path / "plan.png"
    assert main(["plan", "--model", str(tiny_hf_dir), "--hardware", "h100", "--alpha", "0.8", "--max-k", "8",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "recommended draft length k =" in printed and "3.362" in printed  # E(4) at α = 0.8
    assert "G = 4/2 = 2" in printed and "dense model" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_cli_measure_this_machine(tiny_hf_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "humaneval_dev.jsonl").write_text('{"prompt": "def add(a, b):\\n    return a + b\\n\\ndef add(a, b):"}\n')
    assert main(["plan", "--model", str(tiny_hf_dir), "--hardware", "this-machine", "--measure", "--data", str(data),
                 "--max-k", "4", "--threads", "2"]) == 0
    printed = capsys.readouterr().out
    assert "measured T(n)/T(1)" in printed and "α = " in printed
    assert list((tmp_path / "cache" / "specdec" / "costs").glob("*.json"))  # the profile the adaptive policy reads


def test_plan_cli_rejects_bad_hardware(tiny_hf_dir, capsys):
    assert main(["plan", "--model", str(tiny_hf_dir), "--hardware", "tpu9"]) == 2
    assert "--hardware" in capsys.readouterr().err
