"""argmax_rows: torch.argmax's answer (first index of the maximum, NaN rows included) on the SIMD and scalar
paths, with 1 and 2 threads."""
import pytest
import torch

from specdec.kernels import ops


@pytest.fixture(params=[(1, path) for path in ops.KERNEL_ISAS] + [(2, path) for path in ops.KERNEL_ISAS],
                ids=lambda param: f"{param[0]}thread-{param[1]}")
def setting(request):
    threads, path = request.param
    if path not in ops.supported_isas():
        pytest.skip(f"this CPU cannot run the {path} kernels")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    with ops.forced_isa(path):
        yield request.param
    torch.set_num_threads(old)


def _check(logits: torch.Tensor) -> None:
    ids = ops.argmax_rows(logits)
    assert ids.dtype == torch.int64
    assert torch.equal(ids, torch.argmax(logits, dim=-1))


@pytest.mark.parametrize(
    "rows,vocab", [(1, 1), (3, 7), (2, 16), (5, 17), (9, 262144), (4, 151936), (1, 40000), (0, 50)]
)
def test_random_logits(setting, rows, vocab):
    _check(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab)) * 10)


@pytest.mark.parametrize(
    "positions", [(5, 21), (9, 2), (30, 18), (0, 16), (40000, 16384), (16383, 16384, 70000), (70001, 70000)]
)
def test_ties_go_to_the_first_index(setting, positions):
    """Equal maxima in one lane, in different lanes, in the tail, in different pieces (16384 values each)."""
    logits = torch.randn(3, 70003, generator=torch.Generator().manual_seed(1))
    for row, sign in ((0, 1.0), (1, 1.0), (2, -1.0)):  # row 2: ties of a negative maximum among -inf
        if sign < 0:
            logits[row] = float("-inf")
        for position in positions:
            logits[row, position] = 50.0 * sign
    logits[1, positions[0]] = 0.0  # row 1: +0.0 and -0.0 tie as the maximum of a non-positive row
    logits[1] = -logits[1].abs() - 1.0
    logits[1, positions[0]], logits[1, positions[-1]] = -0.0, 0.0
    _check(logits)
    assert ops.argmax_rows(logits)[0] == min(positions)


def test_all_minus_infinity_and_nan_rows(setting):
    logits = torch.full((4, 20000), float("-inf"))
    logits[1, 12345] = float("nan")
    logits[2, 7] = float("nan")
    logits[2, 19000] = 1.0
    logits[3, 3] = float("inf")
    logits[3, 17000] = float("nan")
    _check(logits)


def test_non_contiguous_rows():
    logits = torch.randn(20000, 6).t()  # [6, 20000], stride (1, 6)
    _check(logits)
