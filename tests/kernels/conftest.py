"""Kernel paths for the tests: every test that compares a vector path with the scalar path runs once per vector
path (avx2, avx512, amx), skipped only where this CPU cannot run that path; and the thread counts a test of thread
invariance runs under."""
import pytest
import torch

from specdec.kernels import ops

VECTOR_ISAS = ("avx2", "avx512", "amx")


@pytest.fixture(params=VECTOR_ISAS)
def vector_path(request):
    """Runs the test on one vector kernel path (the scalar path stays reachable with ops.forced_isa("scalar"))."""
    if request.param not in ops.supported_isas():
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    with ops.forced_isa(request.param):
        yield request.param


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Runs the test with 1 and with 2 intra-op threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)
