"""`specdec serve` arguments: loopback by default, every documented option parsed."""
from specdec.cli import build_parser


def test_serve_defaults_to_loopback():
    args = build_parser().parse_args(["serve", "smollm2-135m-instruct"])
    assert (args.host, args.port, args.api_key, args.max_verify_tokens) == ("127.0.0.1", 8000, None, None)


def test_serve_options():
    args = build_parser().parse_args(
        [
            "serve",
            "m",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3}',
            "--host",
            "0.0.0.0",
            "--port",
            "9001",
            "--max-num-seqs",
            "16",
            "--max-model-len",
            "2048",
            "--api-key",
            "k",
            "--max-queue",
            "5",
            "--max-verify-tokens",
            "24",
        ]
    )
    assert (args.max_num_seqs, args.max_model_len, args.max_queue, args.max_verify_tokens) == (16, 2048, 5, 24)
    assert args.handler.__name__ == "cmd_serve"


def test_serve_limits_and_timeouts_reach_the_server_config():
    from specdec.cli import serve_config

    args = build_parser().parse_args(["serve", "m", "--max-request-bytes", "1000", "--max-prompt-chars", "500",
                                      "--max-stop-strings", "4", "--max-stop-chars", "32", "--request-timeout", "9.5",
                                      "--step-timeout", "12", "--unhealthy-after-failed-steps", "5",
                                      "--shutdown-timeout", "3", "--max-queue", "7"])
    config = serve_config(args, environ={})
    assert (config.limits.max_body_bytes, config.limits.max_prompt_chars, config.limits.max_stop_strings,
            config.limits.max_stop_chars) == (1000, 500, 4, 32)
    assert (config.request_timeout_s, config.watchdog.step_timeout_s, config.watchdog.unhealthy_after_failed_steps,
            config.shutdown_timeout_s, config.max_queue) == (9.5, 12.0, 5, 3.0, 7)
    assert config.api_key is None and config.model_name == "m"


def test_serve_defaults_match_the_server_defaults():
    from specdec.cli import serve_config
    from specdec.server.app import ServerConfig

    config = serve_config(build_parser().parse_args(["serve", "m"]), environ={})
    assert config == ServerConfig(model_name="m", api_key=None)


def test_serve_api_key_from_the_environment():
    from specdec.cli import serve_config

    args = build_parser().parse_args(["serve", "m"])
    assert serve_config(args, environ={"SPECDEC_API_KEY": "from-env"}).api_key == "from-env"
    assert serve_config(args, environ={"SPECDEC_API_KEY": ""}).api_key is None  # empty = no key
    flagged = build_parser().parse_args(["serve", "m", "--api-key", "from-flag"])
    assert serve_config(flagged, environ={"SPECDEC_API_KEY": "from-env"}).api_key == "from-flag"
    assert "from-flag" not in repr(serve_config(flagged, environ={}))  # never printed with the config


def test_serve_rejects_a_bad_limit_before_loading_the_model(capsys):
    from specdec.cli import main

    assert main(["serve", "no-such-model", "--max-request-bytes", "0"]) == 2
    assert "max_body_bytes must be an integer >= 1" in capsys.readouterr().err


def test_serve_logs_specdecs_own_lines_at_its_level(monkeypatch, capsys):
    """A client that left is an info line of specdec.server.app: `specdec serve` shows it in uvicorn's format
    (Python alone would drop it), once however often the logging is configured."""
    import logging

    from specdec.cli import configure_server_logging

    logger = logging.getLogger("specdec")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "level", logger.level)
    configure_server_logging("info")
    configure_server_logging("info")
    logging.getLogger("specdec.server.app").info("client disconnected before its first token")
    logging.getLogger("specdec.server.app").debug("not at info")
    assert capsys.readouterr().err == "INFO:     client disconnected before its first token\n"
    configure_server_logging("warning")
    logging.getLogger("specdec.server.app").info("hidden")
    assert capsys.readouterr().err == ""


def test_serve_draft_policy_reaches_the_llm(monkeypatch):
    """--draft-policy fixed makes every step draft (the soak uses it so that speculation runs under its whole mix);
    adaptive is the default."""
    import pytest

    import specdec.llm
    from specdec.cli import main

    assert build_parser().parse_args(["serve", "m"]).draft_policy == "adaptive"
    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(specdec.llm, "LLM", fake_llm)
    with pytest.raises(Stop):
        main(["serve", "m", "--draft-policy", "fixed", "--threads", "2"])
    assert seen["draft_policy"] == "fixed"
