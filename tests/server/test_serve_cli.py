"""`specdec serve` arguments: loopback by default, every documented option parsed."""
from specdec.cli import build_parser


def test_serve_defaults_to_loopback():
    args = build_parser().parse_args(["serve", "smollm2-135m-instruct"])
    assert (args.host, args.port, args.api_key, args.max_verify_tokens) == ("127.0.0.1", 8000, None, None)


def test_serve_options():
    args = build_parser().parse_args(["serve", "m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                                      "--host", "0.0.0.0", "--port", "9001", "--max-num-seqs", "16", "--max-model-len", "2048",
                                      "--api-key", "k", "--max-queue", "5", "--max-verify-tokens", "24"])
    assert (args.max_num_seqs, args.max_model_len, args.max_queue, args.max_verify_tokens) == (16, 2048, 5, 24)
    assert args.handler.__name__ == "cmd_serve"
