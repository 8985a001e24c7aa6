"""The tensor-parallel benchmark's parts (the run itself spawns processes and loads the 1.5B target: see its
docstring for the command)."""
import pytest

from specdec.bench import tp_bench


def test_the_all_reduce_fit_recovers_latency_and_bandwidth():
    samples = [(size, 50e-6 + size / 2e9) for size in (6144, 24576, 98304, 393216)]
    fit = tp_bench.fit_latency_bandwidth(samples)
    assert fit.latency_s == pytest.approx(50e-6, rel=1e-6)
    assert fit.bandwidth == pytest.approx(2e9, rel=1e-6)
    flat = tp_bench.fit_latency_bandwidth([(1024, 1e-4), (4096, 1e-4)])
    assert flat.bandwidth > 1e15 and flat.latency_s == pytest.approx(1e-4)  # no growth: no bandwidth term


def test_divergence():
    assert tp_bench.divergence([1, 2, 3], [1, 2, 3]) is None
    assert tp_bench.divergence([1, 2, 3], [1, 5, 3]) == 1
    assert tp_bench.divergence([1, 2], [1, 2, 3]) == 2


def test_rows_and_table():
    single = tp_bench.Row(1, "plain", 64, 3.2, 0, 0.0, 0.0, None, None)
    split = tp_bench.Row(2, "ngram", 64, 4.0, 32, 1.0, 0.2, 0.5, True)
    assert split.ms_per_token == pytest.approx(62.5)
    assert split.all_reduce_ms_per_forward == pytest.approx(31.25)
    assert split.communication_share == pytest.approx(0.3)
    lines = tp_bench.table([single, split]).splitlines()
    assert lines[2].split("|")[4].strip() == "-"  # one process: no forwards counted, no communication
    assert [cell.strip() for cell in lines[3].split("|")] == ["2", "ngram", "64", "62.5", "32", "31.25", "6.25",
                                                              "30.0%", "0.50", "yes"]


def test_methods_start_with_plain():
    assert tp_bench.parse_args(["--methods", "plain,ngram", "--sizes", "1,2"]).sizes == [1, 2]
    with pytest.raises(SystemExit):
        tp_bench.parse_args(["--methods", "ngram,plain"])
