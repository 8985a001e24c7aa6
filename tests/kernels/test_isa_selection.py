"""SPECDEC_KERNEL_ISA: a path the CPU runs is taken, one it lacks (or an unknown name) is refused with a clear error,
never replaced silently."""
import os
import subprocess
import sys

import pytest

from specdec.kernels import ops


def _run_with(isa: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECDEC_KERNEL_ISA": isa}
    code = "from specdec.kernels import ops; print(ops.kernel_isa(), ops.kernel_build_id(), ops.avx_vnni_active())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_every_path_the_cpu_runs_can_be_forced():
    assert ops.supported_isas()[0] == "scalar"
    if "SPECDEC_KERNEL_ISA" not in os.environ:
        assert ops.kernel_isa() == ops.supported_isas()[-1]  # the best path by default
    for isa in ops.supported_isas():
        result = _run_with(isa)
        assert result.returncode == 0, result.stderr
        name, build_id, avx_vnni = result.stdout.split()
        # cost profiles are kept per path, and apart for the avx2 path's AVX-VNNI variant
        assert name == isa and build_id.endswith("-" + isa + ("-vnni" if avx_vnni == "True" else ""))
        assert avx_vnni == "False" or isa == "avx2"


def test_a_path_the_cpu_lacks_or_an_unknown_one_is_refused():
    lacking = [isa for isa in ops.KERNEL_ISAS if isa not in ops.supported_isas()]
    for isa in ["neon", *lacking]:
        result = _run_with(isa)
        assert result.returncode != 0, isa
        expected = "choose one of scalar, avx2, avx512, amx" if isa == "neon" else f"cannot run the {isa} kernels"
        assert expected in result.stderr, result.stderr


def test_forced_isa_restores_the_previous_path():
    before = ops.kernel_isa()
    with ops.forced_isa("scalar"):
        assert ops.kernel_isa() == "scalar"
    assert ops.kernel_isa() == before
    with pytest.raises(ValueError, match="choose one of"):
        with ops.forced_isa("sse2"):
            pass
