"""The replica benchmark's configurations become the `specdec serve` commands they name."""
import pytest

from specdec.bench.replica_bench import ServerShape, parse_args, parse_configs, server_command


def test_configurations_parse():
    assert parse_configs("1x2, 2x1,single", cores=2) == [ServerShape("1x2", 1, 2), ServerShape("2x1", 2, 1),
                                                         ServerShape("single", None, 2)]
    for bad in ("2y1", "0x2", "2x", "x1"):
        with pytest.raises(SystemExit, match="RxT"):
            parse_configs(bad, cores=2)


def test_every_configuration_holds_the_same_kv_slots():
    args = parse_args(["--total-slots", "16", "--serve-args", "--max-model-len 2048"])
    two = server_command(args, ServerShape("2x1", 2, 1), '{"method": "ngram"}', 8000)
    assert two[two.index("--max-num-seqs") + 1] == "8" and two[two.index("--replicas") + 1] == "2"
    assert two[two.index("--threads") + 1] == "1" and two[-2:] == ["--max-model-len", "2048"]
    assert two[two.index("--speculative-config") + 1] == '{"method": "ngram"}'
    single = server_command(args, ServerShape("single", None, 2), None, 8000)
    assert "--replicas" not in single and "--speculative-config" not in single
    assert single[single.index("--max-num-seqs") + 1] == "16"
