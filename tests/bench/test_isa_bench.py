"""isa_bench's llama.cpp peers: labelled llama-bench binaries, checked before any model loads."""
import pytest

from specdec.bench.isa_bench import parse_llama_bench


def test_llama_bench_binaries_are_labelled(tmp_path):
    avx2, native = tmp_path / "avx2-bench", tmp_path / "native-bench"
    avx2.write_text("")
    native.write_text("")
    assert parse_llama_bench([f"avx2={avx2}", f"native={native}"]) == {"avx2": str(avx2), "native": str(native)}
    assert parse_llama_bench([str(avx2)]) == {"llama.cpp": str(avx2)}


def test_a_missing_binary_or_a_repeated_label_is_refused(tmp_path):
    binary = tmp_path / "llama-bench"
    binary.write_text("")
    with pytest.raises(SystemExit, match="no llama-bench binary at"):
        parse_llama_bench([f"avx2={tmp_path / 'absent'}"])
    with pytest.raises(SystemExit, match="given twice"):
        parse_llama_bench([f"a={binary}", f"a={binary}"])
