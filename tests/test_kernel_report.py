"""Never silently slow: the kernel path a process runs, the warning on the scalar path and the torch fallback (why,
and what it costs), and the line `specdec generate` prints."""
import pytest
import torch

from specdec.cli import main
from specdec.kernels import ops
from specdec.kernels.report import announce_kernels, kernel_report


@pytest.fixture
def cpu(monkeypatch):
    """Pretends the kernels run `isa` on a CPU that supports `supported` (kernel paths as the extension names them)."""
    monkeypatch.delenv("SPECDEC_KERNEL_ISA", raising=False)
    monkeypatch.delenv("SPECDEC_DISABLE_KERNELS", raising=False)

    def pretend(isa: str, supported: tuple[str, ...], avx_vnni: bool = False) -> None:
        monkeypatch.setattr(ops, "kernel_isa", lambda: isa)
        monkeypatch.setattr(ops, "supported_isas", lambda: supported)
        monkeypatch.setattr(ops, "kernel_build_id", lambda: "torch" if isa == "torch" else f"q8-0123456789abcdef-{isa}")
        monkeypatch.setattr(ops, "avx_vnni_active", lambda: avx_vnni)

    return pretend


def test_a_simd_path_is_named_without_a_warning(cpu):
    cpu("avx512", ("scalar", "avx2", "avx512"))
    report = kernel_report()
    threads = torch.get_num_threads()
    assert report.line() == f"[kernels: avx512 (q8 vnni layout), {threads} thread{'s' if threads > 1 else ''}]"
    assert report.warning is None
    assert report.to_dict() == {"kernel_isa": "avx512", "supported_kernel_isas": ["scalar", "avx2", "avx512"],
                                "kernel_weights": "q8 vnni layout", "kernel_threads": threads,
                                "kernel_build": "q8-0123456789abcdef-avx512", "kernel_warning": None,
                                "bit_exact": True, "kernel_avx_vnni": False}
    assert kernel_report(weight_format="fp32").line().startswith("[kernels: avx512 (fp32), ")


def test_the_avx2_paths_avx_vnni_variant_is_named(cpu):
    cpu("avx2", ("scalar", "avx2", "avx512"), avx_vnni=True)
    report = kernel_report()
    assert report.line().startswith("[kernels: avx2 with AVX-VNNI (q8 amx layout), ")
    assert report.to_dict()["kernel_avx_vnni"] is True and report.warning is None
    cpu("avx2", ("scalar", "avx2", "avx512"))
    assert kernel_report().line().startswith("[kernels: avx2 (q8 amx layout), ")


@pytest.mark.skipif(not ops.kernels_available(), reason="the kernel paths need the compiled extension")
def test_the_build_id_keys_the_avx_vnni_variant_apart():
    """Cost profiles are keyed by the build id: the AVX-VNNI variant of the avx2 path has costs of its own."""
    with ops.forced_isa("avx2"):
        assert ops.kernel_build_id().endswith("-avx2-vnni" if ops.avx_vnni_active() else "-avx2")
    with ops.forced_isa("scalar"):
        assert ops.kernel_build_id().endswith("-scalar") and not ops.avx_vnni_active()


def test_the_scalar_path_on_a_cpu_without_avx2_says_why_and_what_it_costs(cpu):
    cpu("scalar", ("scalar",))
    warning = kernel_report().warning
    assert warning.startswith("specdec runs the scalar kernels because this CPU lacks AVX2 + FMA + F16C: ")
    assert "about 6x slower decoding and 40x slower prefill than the avx2 path" in warning


def test_a_forced_scalar_path_says_it_was_forced(cpu, monkeypatch):
    cpu("scalar", ("scalar", "avx2"))
    monkeypatch.setenv("SPECDEC_KERNEL_ISA", "scalar")
    assert "because SPECDEC_KERNEL_ISA=scalar forces the portable path: about 6x slower" in kernel_report().warning


def test_the_torch_fallback_says_why_and_that_it_is_not_row_invariant(cpu, monkeypatch):
    cpu("torch", ())
    monkeypatch.setenv("SPECDEC_DISABLE_KERNELS", "1")
    report = kernel_report()
    assert report.line().startswith("[kernels: torch (q8 vnni layout), ")
    assert report.warning.startswith("specdec runs the torch fallback because SPECDEC_DISABLE_KERNELS=1 turns the "
                                     "compiled kernels off: ")
    assert "not row invariant: speculative greedy output may differ from plain decoding" in report.warning
    monkeypatch.delenv("SPECDEC_DISABLE_KERNELS")
    monkeypatch.setattr(ops, "_build_failures", ["CalledProcessError: ninja failed"])
    assert "because the compiled kernels failed to build or load (CalledProcessError: ninja failed)" in (
        kernel_report().warning)


def test_cuda_tensors_run_the_torch_fallback(cpu):
    cpu("avx2", ("scalar", "avx2"))
    report = kernel_report("cuda")
    assert (report.isa, report.build) == ("torch", "torch")
    assert "because the model is on CUDA, where specdec has no kernels of its own" in report.warning


def test_announce_prints_the_line_and_the_warning(cpu, capsys):
    cpu("scalar", ("scalar",))
    report = announce_kernels()
    assert capsys.readouterr().err == f"{report.line()}\n[warning: {report.warning}]\n"


def _path_named() -> str:
    """The running path as the kernel line names it (the avx2 path's AVX-VNNI variant included)."""
    return f"{ops.kernel_isa()} with AVX-VNNI" if ops.avx_vnni_active() else ops.kernel_isa()


def test_generate_prints_the_kernel_path(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--max-tokens", "2", "--threads", "2", "abc"]) == 0
    err = capsys.readouterr().err
    assert f"[kernels: {_path_named()} (q8 {ops.default_q8_layout()} layout), 2 threads]\n" in err


def test_generate_warns_on_the_scalar_path(tiny_model_dir, cpu, capsys):
    cpu("scalar", ("scalar",))
    assert main(["generate", "--model", str(tiny_model_dir), "--max-tokens", "2", "--threads", "2", "abc"]) == 0
    err = capsys.readouterr().err
    assert "[kernels: scalar (q8 vnni layout), 2 threads]\n[warning: specdec runs the scalar kernels because this " \
           "CPU lacks AVX2 + FMA + F16C: about 6x slower" in err


def test_serve_prints_the_kernel_path_before_serving(tiny_model_dir, monkeypatch, capsys):
    from specdec.server.app import GracefulServer

    monkeypatch.setattr(GracefulServer, "run", lambda self, **kwargs: None)  # no server: only what it prints before
    assert main(["serve", str(tiny_model_dir), "--threads", "2", "--max-model-len", "64"]) == 0
    err = capsys.readouterr().err
    assert f"[kernels: {_path_named()} (q8 {ops.default_q8_layout()} layout), 2 threads]\n[serving " in err


def test_fp32_weights_warn_that_they_are_not_row_invariant():
    report = kernel_report("cpu", "fp32")
    assert report.warning is not None and "not row invariant" in report.warning
    assert report.warning.startswith("specdec runs fp32 weights because --weight-format fp32")


def test_mixed_formats_are_named_with_their_bytes():
    report = kernel_report("cpu", "auto", {"q4": 621_000_000, "q8": 747_000_000})
    assert report.weights == f"auto: q4 621 MB + q8 {ops.default_q8_layout()} layout 747 MB"
    assert kernel_report("cpu", "auto", {"q8": 5}).weights == f"q8 {ops.default_q8_layout()} layout"


@pytest.mark.parametrize("isa,device,weight_format,bit_exact", [
    ("avx512", "cpu", "q8", True), ("avx2", "cpu", "q4", True), ("amx", "cpu", "auto", True),
    ("scalar", "cpu", "q8", True),  # slow, but the same fixed order
    ("avx512", "cpu", "fp32", False),  # torch's F.linear
    ("torch", "cpu", "q8", False),  # the fallback: kernels disabled, failed to build, or a CPU other than x86-64
    ("avx2", "cuda", "q8", False),  # CUDA tensors take the torch fallback
])
def test_bit_exact_only_on_the_compiled_kernels_with_quantized_weights_on_the_cpu(cpu, isa, device, weight_format,
                                                                                 bit_exact):
    cpu(isa, () if isa == "torch" else ("scalar", isa))
    report = kernel_report(device, weight_format)
    assert report.bit_exact is bit_exact and report.to_dict()["bit_exact"] is bit_exact
    assert bit_exact or report.warning is not None  # never inexact without a warning
