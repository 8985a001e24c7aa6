"""GET /v1/specdec/info names the kernel path the server runs, and carries the warning of a slow one."""
import httpx

from server_helpers import tiny_llm
from specdec.kernels import ops
from specdec.kernels.report import FAST_PATHS
from specdec.server.app import ServerConfig, ServerState


def test_info_names_the_kernel_path(ngram_server):
    info = httpx.get(ngram_server.url + "/v1/specdec/info", timeout=10).json()
    assert info["kernel_isa"] == ops.kernel_isa()
    assert info["supported_kernel_isas"] == list(ops.supported_isas())
    assert info["kernel_build"] == ops.kernel_build_id()
    assert (info["kernel_warning"] is None) == (ops.kernel_isa() in FAST_PATHS)


def test_info_warns_when_only_the_scalar_path_runs(make_tiny_model, tiny_tokenizer, monkeypatch):
    monkeypatch.delenv("SPECDEC_KERNEL_ISA", raising=False)
    monkeypatch.setattr(ops, "kernel_isa", lambda: "scalar")
    monkeypatch.setattr(ops, "supported_isas", lambda: ("scalar",))
    info = ServerState(tiny_llm(make_tiny_model, tiny_tokenizer), ServerConfig()).spec_info()
    assert (info["kernel_isa"], info["supported_kernel_isas"]) == ("scalar", ["scalar"])
    assert info["kernel_warning"].startswith("specdec runs the scalar kernels because this CPU lacks AVX2 + FMA + F16C")
