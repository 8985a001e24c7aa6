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


# ---- tensor parallel: the all-reduce cost model ---------------------------------------------------------------------
LINK = plan.Interconnect("test link", latency_s=10e-6, bandwidth=100e9)


def test_all_reduce_seconds_is_latency_plus_the_ring_share_over_bandwidth():
    assert plan.all_reduce_seconds(1e6, 1, LINK) == 0.0
    assert plan.all_reduce_seconds(1e6, 2, LINK) == pytest.approx(10e-6 + 1e6 / 100e9)  # 2(N-1)/N = 1
    assert plan.all_reduce_seconds(1e6, 4, LINK) == pytest.approx(10e-6 + 1.5e6 / 100e9)
    assert plan.all_reduce_seconds(0, 8, LINK) == pytest.approx(10e-6)  # small messages: the latency


def test_a_tensor_parallel_step_splits_the_layers_and_adds_two_all_reduces_per_layer():
    config = tiny_config("llama", hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, vocab_size=128256)
    stats = plan.ModelStats.of(config)
    h100 = plan.HARDWARE["h100"]
    step = plan.tensor_parallel_step(stats, h100, "bf16", 1, 5, 1024, 2, 2, LINK)
    layer_params = stats.streamed_params - stats.output_params
    kv_read = 32 * 1024 * 2 * 8 * 128 * 2 / 2
    assert step.compute_s == pytest.approx(((layer_params / 2 + stats.output_params) * 2 + kv_read) / 3.35e12)
    assert step.communication_s == pytest.approx(2 * 32 * (10e-6 + 5 * 4096 * 2 / 100e9))
    assert step.seconds == pytest.approx(step.compute_s + step.communication_s)
    single = plan.tensor_parallel_step(stats, h100, "bf16", 1, 5, 1024, 2, 1, LINK)
    assert single.communication_s == 0 and single.compute_s == plan.roofline_seconds(stats, h100, "bf16", 1, 5, 1024, 2)


def test_tensor_parallel_pays_for_a_large_model_on_nvlink_not_for_a_small_one_over_ethernet():
    large = plan.ModelStats.of(tiny_config("llama", hidden_size=8192, intermediate_size=28672, num_layers=80,
                                           num_heads=64, num_kv_heads=8, head_dim=128, vocab_size=128256))
    small = plan.ModelStats.of(tiny_config("qwen2", hidden_size=1536, intermediate_size=8960, num_layers=28,
                                           num_heads=12, num_kv_heads=2, head_dim=128, vocab_size=151936))
    h100 = plan.HARDWARE["h100"]

    def speedup(stats, size, link):
        one = plan.tensor_parallel_step(stats, h100, "bf16", 1, 1, 1024, 2, 1, link).seconds
        return one / plan.tensor_parallel_step(stats, h100, "bf16", 1, 1, 1024, 2, size, link).seconds

    assert speedup(large, 8, plan.INTERCONNECTS["nvlink4"]) > 4
    assert speedup(small, 2, plan.INTERCONNECTS["100gbe"]) < 1
    table = plan.tensor_parallel_table(small, h100, "bf16", 1, 1, 1024, 2, plan.INTERCONNECTS["nvlink4"])
    # 4 and 8 ranks would split its 2 key/value heads: not offered
    assert [line.split("|")[0].strip() for line in table.splitlines()[3:]] == ["1", "2"]


def test_parse_interconnect():
    assert plan.parse_interconnect("NVLink4").bandwidth == 450e9
    custom = plan.parse_interconnect("alpha=300us,bw=1.5G")
    assert (custom.latency_s, custom.bandwidth) == (pytest.approx(300e-6), 1.5e9)
    with pytest.raises(ValueError, match="--interconnect"):
        plan.parse_interconnect("carrier-pigeon")


def test_plan_cli_tensor_parallel_rows(tiny_hf_dir, capsys):
    assert main(["plan", "--model", str(tiny_hf_dir), "--hardware", "h100", "--max-k", "4",
                 "--tensor-parallel-size", "2", "--interconnect", "alpha=10us,bw=100G"]) == 0
    printed = capsys.readouterr().out
    assert "tensor parallel over 2 x custom" in printed
    assert "tensor parallel over custom (α = 10.0 us, β = 100.0 GB/s" in printed
    assert main(["plan", "--model", str(tiny_hf_dir), "--hardware", "this-machine", "--tensor-parallel-size", "2"]) == 2
    assert "needs named hardware" in capsys.readouterr().err
