"""`specdec` command line: generate, models, pull, export-hf (bench, serve and plan come with their issues)."""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from specdec.config import DRAFT_POLICIES
from specdec.engine.sequence import TokenKind

if TYPE_CHECKING:
    from specdec.server.app import ServerConfig

API_KEY_VARIABLE = "SPECDEC_API_KEY"  # `specdec serve` reads its API key here when --api-key is not given

COLOURS = {  # ANSI colours for --show-drafts
    TokenKind.ACCEPTED: "\033[32m",  # green: accepted draft token
    TokenKind.RECOVERED: "\033[33m",  # yellow: the target's correction at a rejected draft
    TokenKind.BONUS: "\033[36m",  # cyan: bonus token after a fully accepted draft
    TokenKind.TARGET: "",
}
RESET = "\033[0m"


def _add_format_args(parser: argparse.ArgumentParser) -> None:
    from specdec.models.layers import WEIGHT_FORMATS

    parser.add_argument("--weight-format", default="auto", choices=WEIGHT_FORMATS,
                        help="auto (default): q4 where the file stores Q4_K (lossless), q8 elsewhere; q4: also "
                             "quantize fp16/bf16/fp32/Q4_0/Q4_1 layers to 4 bits at load; q8: int8 everywhere; "
                             "fp32: the reference (not row invariant)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16", "float32"],
                        help="KV cache: auto = float16 with q4/q8 weights, float32 with fp32 weights")


def _add_tensor_parallel_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split the target over N processes (gloo on CPU, NCCL on CUDA), each with cores/N "
                             "threads; docs/tensor-parallel.md")


def _add_generate_args(parser: argparse.ArgumentParser) -> None:
    from specdec.models.catalog import DEFAULT_MODEL

    parser.add_argument("prompt", help="prompt text (use --chat to wrap it in the model's chat template)")
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"catalogue name, .gguf path or HF directory (default {DEFAULT_MODEL})"
    )
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="subtracted from the logit of every token the output holds (0 = off)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="subtracted once per occurrence of a token in the output (0 = off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="tokens of the prompt or output: positive logits divided by it, negative ones multiplied "
                             "(1 = off)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens below min-p times the most likely token's probability (0 = off)")
    parser.add_argument("--min-tokens", type=int, default=0, help="end of sequence banned before this many tokens")
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", help="the output is JSON matching this JSON Schema file")
    constraint.add_argument("--regex", help="the whole output matches this regular expression")
    constraint.add_argument("--grammar", metavar="FILE", help="the output follows this grammar file (llguidance's "
                                                              "Lark dialect)")
    parser.add_argument(
        "--speculative-config", default=None, help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\''
    )
    parser.add_argument(
        "--show-drafts", action="store_true", help="colour accepted (green), recovered (yellow) and bonus (cyan) tokens"
    )
    parser.add_argument(
        "--compare-plain", action="store_true", help="also decode without speculation and print the speed-up"
    )
    parser.add_argument(
        "--draft-policy",
        default="adaptive",
        choices=DRAFT_POLICIES,
        help="adaptive: k per step from acceptance and measured costs (<= num_speculative_tokens); fixed: always k",
    )
    _add_format_args(parser)
    _add_tensor_parallel_arg(parser)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default=None)


def _stream_printer(llm, show_drafts: bool):
    def on_output(output) -> None:
        if show_drafts:
            for token_id, kind in zip(output.new_token_ids, output.new_token_kinds):
                text = llm.tokenizer.decode([token_id])
                sys.stdout.write(f"{COLOURS[kind]}{text}{RESET if COLOURS[kind] else ''}")
        else:
            sys.stdout.write(output.new_text)
        sys.stdout.flush()

    return on_output


def generate_params(args: argparse.Namespace):
    """`specdec generate`'s SamplingParams (the constraint files read here)."""
    from pathlib import Path

    from specdec.llm import sampling_params_from

    read = lambda path: Path(path).read_text(encoding="utf-8") if path else None
    return sampling_params_from(None, dict(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens,
        stop=tuple(args.stop), ignore_eos=args.ignore_eos, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty, min_p=args.min_p,
        min_tokens=args.min_tokens, json_schema=read(args.json_schema), regex=args.regex, grammar=read(args.grammar)))


def announce_draft_model(llm) -> None:
    """The draft model's weights beside the kernel line, when the drafter is a draft model (its format is its own:
    q4-all unless the speculative config says otherwise)."""
    from specdec.kernels.report import describe_weights
    from specdec.models.transformer import Transformer

    draft = getattr(llm.engine.drafter, "model", None)
    if isinstance(draft, Transformer):
        weights = describe_weights(draft.weight_format, draft.linear_bytes())
        print(f"[draft model: {draft.source} ({weights})]", file=sys.stderr, flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    from specdec.config import SamplingParams
    from specdec.kernels.report import announce_kernels
    from specdec.llm import LLM
    from specdec.runtime import configure_threads

    configure_threads(args.threads)
    params = generate_params(args)  # before the model loads: a bad option or constraint file stops here
    started = time.perf_counter()
    llm = LLM(model=args.model, speculative_config=args.speculative_config, weight_format=args.weight_format,
              kv_cache_dtype=args.kv_cache_dtype,
              max_model_len=args.max_model_len, max_num_seqs=1, device=args.device, draft_policy=args.draft_policy,
              tensor_parallel_size=args.tensor_parallel_size)
    print(f"[loaded {args.model} in {time.perf_counter() - started:.1f} s]", file=sys.stderr)
    announce_kernels(llm.model.device, args.weight_format, linear_bytes=llm.model.linear_bytes())
    announce_draft_model(llm)
    plain = None
    if args.compare_plain and llm.spec_config is not None:
        llm.generate(args.prompt, SamplingParams(max_tokens=4), chat=args.chat, speculative=False)  # warm-up
        print("--- plain decoding ---", file=sys.stderr)
        plain = llm.generate(
            args.prompt, params, chat=args.chat, speculative=False, on_output=_stream_printer(llm, False)
        )[0]
        print(f"\n[plain: {len(plain.token_ids)} tokens, {plain.tokens_per_s:.1f} tok/s; first token after "
              f"{plain.first_token_s:.2f} s, then {plain.decode_tokens_per_s:.1f} tok/s]", file=sys.stderr)
        print(f"--- speculative decoding ({llm.spec_config.method}) ---", file=sys.stderr)
    result = llm.generate(args.prompt, params, chat=args.chat, on_output=_stream_printer(llm, args.show_drafts))[0]
    print(file=sys.stderr)
    _print_summary(result, plain, llm.spec_config is not None)
    return 0


def _print_summary(result, plain, speculative: bool) -> None:
    print(f"[{len(result.token_ids)} tokens in {result.elapsed_s:.2f} s: {result.tokens_per_s:.1f} tok/s; first token "
          f"after {result.first_token_s:.2f} s, then {result.decode_tokens_per_s:.1f} tok/s; "
          f"finish: {result.finish_reason}]", file=sys.stderr)
    if speculative:
        m = result.metrics
        positions = " ".join(f"{rate:.2f}" for rate in m.position_acceptance_rates)
        print(f"[speculation: {m.verify_steps} verify steps, {m.drafted_tokens} drafted, {m.accepted_tokens} accepted, "
              f"acceptance rate {m.acceptance_rate:.2f}, mean accepted length {m.mean_accepted_length:.2f}, "
              f"per position: {positions}]", file=sys.stderr)
        print(
            f"[time: drafter {m.draft_time_s:.2f} s, target {m.target_time_s:.2f} s, verifier {m.verify_time_s:.2f} s]",
            file=sys.stderr,
        )
    if plain is not None:
        identical = plain.token_ids == result.token_ids
        ratio = lambda ours, reference: ours / reference if reference else float("nan")  # noqa: E731
        print(
            f"[speed-up over plain decoding: {ratio(result.decode_tokens_per_s, plain.decode_tokens_per_s):.2f}x "
            f"in the decode phase ({plain.decode_tokens_per_s:.1f} -> {result.decode_tokens_per_s:.1f} tok/s after "
            f"the first token), {ratio(result.tokens_per_s, plain.tokens_per_s):.2f}x end to end with the "
            f"{len(result.prompt_token_ids)}-token prompt's prefill ({plain.tokens_per_s:.1f} -> "
            f"{result.tokens_per_s:.1f} tok/s); output identical to plain: {'yes' if identical else 'NO'}]",
            file=sys.stderr,
        )


def cmd_models(args: argparse.Namespace) -> int:
    from specdec.models.catalog import CATALOG, DEFAULT_MODEL, is_pulled

    for entry in CATALOG.values():
        mark = "pulled" if is_pulled(entry.name) else "not pulled"
        default = " (default)" if entry.name == DEFAULT_MODEL else ""
        print(f"{entry.name:32s} {mark:11s} {entry.description}{default}")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from specdec.models.catalog import pull

    for name in args.names:
        path = pull(name, progress=lambda message: print(message, file=sys.stderr))
        print(path)
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from specdec.models.export import export_model_hf

    started = time.perf_counter()
    out = export_model_hf(args.model, args.out_dir, args.dtype)
    print(f"[exported {args.model} in {time.perf_counter() - started:.1f} s]", file=sys.stderr)
    print(out)
    return 0


def cmd_build_kernels(args: argparse.Namespace) -> int:
    from specdec.kernels import build_kernels

    started = time.perf_counter()
    ext = build_kernels()
    built = "the installed build" if ext.build_origin == "installed" else f"the development build in {ext.build_origin}"
    print(f"kernels ready: {built} ({ext.build_digest}; paths this CPU runs: {', '.join(ext.supported_isas())}) "
          f"({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    return 0


def serve_config(args: argparse.Namespace, environ: Mapping[str, str]) -> ServerConfig:
    """The server's configuration from `specdec serve`'s options; the API key from --api-key, else from
    SPECDEC_API_KEY (where `ps` does not show it)."""
    from specdec.server.app import ServerConfig
    from specdec.server.engine_loop import WatchdogConfig
    from specdec.server.protocol import RequestLimits

    return ServerConfig(
        model_name=args.served_model_name or args.model,
        api_key=args.api_key or environ.get(API_KEY_VARIABLE) or None,
        max_queue=args.max_queue,
        limits=RequestLimits(max_body_bytes=args.max_request_bytes, max_prompt_chars=args.max_prompt_chars,
                             max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars),
        watchdog=WatchdogConfig(step_timeout_s=args.step_timeout,
                                unhealthy_after_failed_steps=args.unhealthy_after_failed_steps),
        request_timeout_s=args.request_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
    )


def serve_llm_options(args: argparse.Namespace) -> dict:
    """The `LLM(...)` arguments of `specdec serve`'s engine (each replica's, with --replicas)."""
    extra = {} if args.max_verify_tokens is None else {"max_verify_tokens": args.max_verify_tokens}
    return dict(model=args.model, speculative_config=args.speculative_config, weight_format=args.weight_format,
                kv_cache_dtype=args.kv_cache_dtype, prefix_cache_tokens=args.prefix_cache_tokens,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, device=args.device,
                draft_policy=args.draft_policy, tensor_parallel_size=args.tensor_parallel_size, **extra)


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from specdec.kernels.report import announce_kernels
    from specdec.llm import LLM
    from specdec.runtime import configure_threads
    from specdec.server.app import GracefulServer, create_app

    config = serve_config(args, os.environ)  # a bad limit stops the start before the model loads
    configure_server_logging(args.log_level)
    if args.replicas is not None:  # N engines behind one endpoint, on Ray (server/replicas.py)
        from specdec.server.replicas import serve_replicas

        return serve_replicas(args, config, serve_llm_options(args))
    configure_threads(args.threads)
    llm = LLM(**serve_llm_options(args))
    app = create_app(llm, config)
    announce_kernels(llm.model.device, args.weight_format, linear_bytes=llm.model.linear_bytes())
    announce_draft_model(llm)
    print(f"[serving {app.state.server.model_name} on http://{args.host}:{args.port}]", file=sys.stderr)
    GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)).run()
    return 0


SERVER_LOG_HANDLER = "specdec-serve"


def configure_server_logging(level: str) -> None:
    """specdec's own log lines (a client that left, an engine step that raised) on stderr beside uvicorn's, in
    its format and at --log-level. Without a handler Python drops the info lines and prints the others bare."""
    import logging

    from uvicorn.logging import DefaultFormatter

    class CurrentStderr(logging.StreamHandler):
        """Writes to sys.stderr as it is when a record comes, not as it was when the handler was made."""

        def emit(self, record: logging.LogRecord) -> None:
            self.stream = sys.stderr
            super().emit(record)

    handler = CurrentStderr()
    handler.set_name(SERVER_LOG_HANDLER)
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s", use_colors=False))
    logger = logging.getLogger("specdec")
    logger.handlers = [h for h in logger.handlers if h.get_name() != SERVER_LOG_HANDLER] + [handler]
    logger.setLevel(logging.DEBUG if level.lower() == "trace" else level.upper())


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="catalogue name, .gguf path or HF directory")
    parser.add_argument(
        "--speculative-config", default=None, help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\''
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="KV-cache slots = requests decoded together")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_VARIABLE}, which "
                             "`ps` does not show)")
    parser.add_argument("--max-queue", type=int, default=256, help="waiting requests before new ones get 503")
    parser.add_argument(
        "--max-verify-tokens", type=int, default=None, help="verify-token budget per step (draft policy)"
    )
    parser.add_argument("--draft-policy", default="adaptive", choices=DRAFT_POLICIES,
                        help="adaptive: k per request and step from acceptance and measured costs "
                             "(<= num_speculative_tokens); fixed: num_speculative_tokens, shortened only so that a "
                             "step verifies at most --max-verify-tokens rows")
    parser.add_argument("--prefix-cache-tokens", type=int, default=8192,
                        help="keys/values of earlier requests' tokens kept for prompts that start with them "
                             "(a shared system turn, the next turn of a chat); 0 = off (default 8192)")
    parser.add_argument("--served-model-name", default=None, help="model id clients send (default: MODEL as given)")
    _add_server_limit_args(parser)
    _add_format_args(parser)
    _add_tensor_parallel_arg(parser)
    from specdec.server.replicas import add_replica_arguments

    add_replica_arguments(parser)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (with --replicas: per replica; default: the cores divided among them)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--log-level", default="info")


def _add_server_limit_args(parser: argparse.ArgumentParser) -> None:
    from specdec.server.engine_loop import WatchdogConfig
    from specdec.server.protocol import RequestLimits

    limits, watchdog = RequestLimits(), WatchdogConfig()
    parser.add_argument("--max-request-bytes", type=int, default=limits.max_body_bytes,
                        help=f"request bodies over this many bytes get 413 (default {limits.max_body_bytes})")
    parser.add_argument("--max-prompt-chars", type=int, default=limits.max_prompt_chars,
                        help="prompts (or all chat messages together) over this many characters get 400, before "
                             f"tokenization (default {limits.max_prompt_chars})")
    parser.add_argument("--max-stop-strings", type=int, default=limits.max_stop_strings,
                        help=f"stop strings per request (default {limits.max_stop_strings})")
    parser.add_argument("--max-stop-chars", type=int, default=limits.max_stop_chars,
                        help=f"characters per stop string (default {limits.max_stop_chars})")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds from a request's arrival to its last token; past it the request gets 504 "
                             "request_timeout and its slot is freed (default: none)")
    parser.add_argument("--step-timeout", type=float, default=watchdog.step_timeout_s,
                        help="seconds an engine step (with its commands and outputs) may run before the engine "
                             "counts as stalled: /health 503, waiting requests fail with 503 engine_stalled "
                             f"(default {watchdog.step_timeout_s:g})")
    parser.add_argument("--unhealthy-after-failed-steps", type=int, default=watchdog.unhealthy_after_failed_steps,
                        help="/health is 503 after this many engine steps in a row raised "
                             f"(default {watchdog.unhealthy_after_failed_steps})")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds a shutdown (Ctrl-C, SIGTERM) lets running requests finish; then they end "
                             "with 503 shutting_down (default 30)")


def cmd_bench(args: argparse.Namespace) -> int:
    from specdec.bench.runner import cmd_bench as run

    return run(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from specdec.plan import cmd_plan as run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Speculative-decoding inference engine")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate text from a prompt (optionally speculative)")
    _add_generate_args(generate)
    generate.set_defaults(handler=cmd_generate)
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, speculation)")
    _add_serve_args(serve)
    serve.set_defaults(handler=cmd_serve)
    commands.add_parser("models", help="list the embedded model catalogue").set_defaults(handler=cmd_models)
    pull = commands.add_parser("pull", help="install and assemble catalogue models")
    pull.add_argument("names", nargs="+")
    pull.set_defaults(handler=cmd_pull)
    from specdec.models.export import EXPORT_DTYPES

    export_hf = commands.add_parser("export-hf", help="write a model as a Hugging Face directory (dequantized "
                                                      "safetensors, config.json, tokenizer), e.g. for vLLM")
    export_hf.add_argument("model", help="catalogue name, .gguf path or HF directory")
    export_hf.add_argument("out_dir", help="output directory (created; existing files are overwritten)")
    export_hf.add_argument("--dtype", default="float32", choices=list(EXPORT_DTYPES),
                           help="dtype of the written weights (default float32: the exact dequantized values)")
    export_hf.set_defaults(handler=cmd_export_hf)
    from specdec.bench.runner import add_bench_arguments

    bench = commands.add_parser("bench", help="Spec-Bench-style benchmark of the methods (and peers), lossless check")
    add_bench_arguments(bench)
    bench.set_defaults(handler=cmd_bench)
    from specdec.plan import add_plan_arguments

    plan = commands.add_parser("plan", help="recommended draft length for a model on given hardware, with its reasons")
    add_plan_arguments(plan)
    plan.set_defaults(handler=cmd_plan)
    from specdec.train.cli import add_train_draft_arguments, cmd_train_draft

    train_draft = commands.add_parser(
        "train-draft", help="train an EAGLE head or Medusa heads for a target (self-distillation)"
    )
    add_train_draft_arguments(train_draft)
    train_draft.set_defaults(handler=cmd_train_draft)
    commands.add_parser("build-kernels", help="check that the CPU kernels pip installed match their sources; else "
                                              "compile them now (otherwise done on first use)").set_defaults(
        handler=cmd_build_kernels)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"specdec: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
