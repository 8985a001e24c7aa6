"""`specdec train-draft`: data generation (cached, resumable), training (checkpointed, resumable), head file."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_PROMPTS = ("/work/shared/data/spec_bench_dev.jsonl", "/work/shared/data/humaneval_dev.jsonl")


def add_train_draft_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="target: catalogue name, .gguf path or HF directory")
    parser.add_argument("--method", required=True, choices=["eagle", "medusa"])
    parser.add_argument("--prompts", action="append", default=None,
                        help="Spec-Bench / HumanEval JSONL file (repeatable; default: the two dev files)")
    parser.add_argument("--out", default=None, help="head file (.safetensors; a .json config, .png loss curve and "
                        ".ckpt checkpoint go beside it); default heads/MODEL-METHOD.safetensors")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps in total (a rerun resumes)")
    parser.add_argument(
        "--time-limit-min", type=float, default=None, help="stop this run's training after this many minutes"
    )
    parser.add_argument("--batch-tokens", type=int, default=2048, help="positions per optimizer step")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument(
        "--draft-vocab", type=int, default=8192, help="lm_head rows the head drafts over (most frequent tokens)"
    )
    parser.add_argument(
        "--intermediate-size", type=int, default=None, help="EAGLE layer MLP width (default min(2 x hidden, target's))"
    )
    parser.add_argument("--medusa-heads", type=int, default=4)
    parser.add_argument("--unroll-steps", type=int, default=3,
                        help="EAGLE: draft steps trained per position on the head's own predictions (training-time "
                        "test); 1 = teacher-forced only")
    parser.add_argument("--loss-positions", default="all", choices=["all", "continuation"],
                        help="positions the loss scores: all, or only the target's continuation (where drafting runs)")
    parser.add_argument("--feature-weight", type=float, default=1.0, help="EAGLE: weight of the smooth-L1 state loss")
    parser.add_argument("--token-weight", type=float, default=0.1,
                        help="EAGLE: weight of the KL loss on the draft distribution (EAGLE-1: 0.1)")
    parser.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="training arithmetic: bf16 autocast (fp32 weights and optimizer) or fp32; auto: bf16 where "
        "the device runs it fast (AVX512-BF16/AMX CPUs, CUDA with bf16)",
    )
    parser.add_argument("--eval-prompts", type=int, default=0,
                        help="with --holdout-every: continue this many held-out prompts too and report the head's "
                        "greedy chain acceptance on them after training (their features are cached beside the others)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="greedy continuation length per prompt")
    parser.add_argument("--samples", type=int, default=1,
                        help="continuations per training prompt: the greedy one, then SAMPLES - 1 sampled ones")
    parser.add_argument(
        "--sample-temperature", type=float, default=0.8, help="temperature of the sampled continuations"
    )
    parser.add_argument("--max-len", type=int, default=1024, help="longest training sequence (prompt + continuation)")
    parser.add_argument("--max-prompts", type=int, default=None, help="use N prompts, evenly spaced over the files")
    parser.add_argument("--holdout-every", type=int, default=0, help="leave out every N-th question of each file")
    parser.add_argument("--generate-batch", type=int, default=8, help="prompts generated together (one feature shard)")
    parser.add_argument("--self-instruct", type=int, default=0, metavar="N",
                        help="the target also writes N new questions modelled on the training questions, and its "
                        "continuations of them join the data (see specdec.train.self_instruct)")
    parser.add_argument("--self-instruct-temperature", type=float, default=1.0)
    parser.add_argument("--self-instruct-top-p", type=float, default=0.95)
    parser.add_argument("--self-instruct-max-tokens", type=int, default=192,
                        help="longest question the target writes; only seeds this short are imitated")
    parser.add_argument("--init-from", default=None, metavar="HEAD",
                        help="start from this head file's weights and draft vocabulary (same configuration) instead "
                        "of random ones; a checkpoint of --out, when there is one, still takes precedence")
    parser.add_argument("--features-dir", default=None, help="feature cache (default: beside --out, shared by methods)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-format", default="auto", choices=["auto", "q4", "q8", "fp32"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default=None)


def cmd_train_draft(args: argparse.Namespace) -> int:
    from specdec.heads.config import save_head, target_fingerprint
    from specdec.runtime import configure_threads, default_device, load_model
    from specdec.train.data import FeatureSpec, load_prompts

    _check_arguments(args)
    configure_threads(args.threads)
    model_name = _model_label(args.model)
    out = Path(args.out or f"heads/{model_name}-{args.method}.safetensors")
    target, tokenizer = load_model(args.model, args.weight_format, args.device or default_device())
    prompt_files = tuple(args.prompts or DEFAULT_PROMPTS)
    prompts = load_prompts(tokenizer, prompt_files, args.holdout_every, args.max_prompts)
    spec = FeatureSpec(target_fingerprint(target), prompt_files, len(prompts), args.max_new_tokens, args.max_len,
                       args.generate_batch, args.samples, args.sample_temperature)
    features = Path(args.features_dir or out.parent / f"{model_name}-features")
    started = time.perf_counter()
    sequences = _cached_sequences(target, tokenizer, prompts, features, spec, "target continuations")
    data_s = time.perf_counter() - started
    num_tokens = sum(len(s.token_ids) for s in sequences)
    print(
        f"[data: {len(sequences)} sequences, {num_tokens} tokens in {features} ({data_s:.0f} s this run)]",
        file=sys.stderr,
    )
    instructed = _self_instruct_sequences(args, target, tokenizer, prompt_files, features)
    sequences = sequences + instructed
    held_out = _held_out_sequences(args, target, tokenizer, prompt_files, features)
    trainer, finished = _train(args, target, sequences, out)
    history = trainer.state.history
    tail = history[-20:]
    training = {
        "prompt_files": list(prompt_files),
        "sequences": len(sequences),
        "tokens": sum(len(s.token_ids) for s in sequences),
        "continuation_tokens": sum(len(s.token_ids) - s.prompt_length for s in sequences),
        "samples": args.samples,
        "sample_temperature": args.sample_temperature,
        "steps": trainer.state.step,
        "train_seconds": round(trainer.state.train_seconds, 1),
        "batch_tokens": args.batch_tokens,
        "lr": args.lr,
        "holdout_every": args.holdout_every,
        "max_new_tokens": args.max_new_tokens,
        "unroll_steps": args.unroll_steps,
        "device": str(target.device),
        "loss_positions": args.loss_positions,
        "feature_weight": args.feature_weight,
        "token_weight": args.token_weight,
        "precision": trainer.settings.precision,
        "final_loss": sum(r.loss for r in tail) / len(tail),
        "final_accuracy": sum(r.accuracy for r in tail) / len(tail),
        "first_loss": history[0].loss,
        "init_from": args.init_from,
        "self_instruct": {
            "questions": len(instructed),
            "tokens": sum(len(s.token_ids) for s in instructed),
            "temperature": args.self_instruct_temperature,
            "top_p": args.self_instruct_top_p,
            "max_tokens": args.self_instruct_max_tokens,
        }
        if instructed
        else None,
    }
    if held_out:
        training["held_out"] = _evaluate(trainer, held_out, max(args.unroll_steps, 5 if args.method == "eagle" else 1))
    save_head(out, trainer.config, trainer.head.state_dict(), trainer.parts.draft_token_ids, training)
    _plot(trainer, out)
    print(json.dumps(training), file=sys.stderr)
    state = "done" if finished else f"stopped at step {trainer.state.step}/{args.steps}; rerun to resume"
    print(f"[{args.method} head written to {out} ({state})]", file=sys.stderr)
    return 0


def _model_label(model: str) -> str:
    """A file-name label for --model: a .gguf file's stem, a directory's name, a catalogue name as it is (its dots
    are part of the name: qwen2.5-coder-1.5b-instruct)."""
    path = Path(model)
    return path.stem if path.is_file() else path.name


def _check_arguments(args) -> None:
    """Settings that cannot work, refused before any model is loaded."""
    if args.samples < 1 or args.sample_temperature <= 0:
        raise ValueError(
            f"--samples must be >= 1 and --sample-temperature > 0 (got {args.samples}, {args.sample_temperature})"
        )
    if args.self_instruct < 0 or args.self_instruct_max_tokens < 1 or args.self_instruct_temperature <= 0 \
            or not 0 < args.self_instruct_top_p <= 1:
        raise ValueError(
            "--self-instruct must be >= 0, --self-instruct-max-tokens >= 1, --self-instruct-temperature > 0 "
            f"and --self-instruct-top-p in (0, 1] (got {args.self_instruct}, {args.self_instruct_max_tokens}, "
            f"{args.self_instruct_temperature}, {args.self_instruct_top_p})"
        )
    if args.init_from is not None and not Path(args.init_from).is_file():
        raise FileNotFoundError(f"--init-from: no such head file: {args.init_from}")
    if args.eval_prompts > 0 and args.holdout_every <= 0:
        raise ValueError("--eval-prompts needs --holdout-every (the evaluation prompts are the held-out ones)")


def _held_out_sequences(args, target, tokenizer, prompt_files, features: Path):
    """The evaluation sequences (held-out prompts' greedy continuations and features, cached), or [] without
    --eval-prompts."""
    from specdec.heads.config import target_fingerprint
    from specdec.train.data import FeatureSpec, load_prompts

    if args.eval_prompts <= 0:
        return []
    prompts = load_prompts(tokenizer, prompt_files, args.holdout_every, args.eval_prompts, held_out=True)
    spec = FeatureSpec(target_fingerprint(target), prompt_files, len(prompts), args.max_new_tokens, args.max_len,
                       args.generate_batch)
    return _cached_sequences(target, tokenizer, prompts, Path(f"{features}-heldout{args.holdout_every}"), spec,
                             "held-out continuations")


def _self_instruct_sequences(args, target, tokenizer, prompt_files, features: Path):
    """The target's continuations of the questions it wrote itself (both cached beside the other features), or []
    without --self-instruct."""
    from tqdm import tqdm

    from specdec.heads.config import target_fingerprint
    from specdec.train.data import FeatureSpec, load_prompts
    from specdec.train.self_instruct import SelfInstructSpec, training_seeds, write_self_instruct_questions

    if args.self_instruct <= 0:
        return []
    seeds = training_seeds(prompt_files, args.holdout_every, tokenizer, args.self_instruct_max_tokens)
    spec = SelfInstructSpec(target_fingerprint(target), tuple(prompt_files), args.holdout_every, args.self_instruct,
                            args.self_instruct_temperature, args.self_instruct_top_p, args.self_instruct_max_tokens,
                            args.seed)
    directory = Path(f"{features}-self-instruct")
    with tqdm(total=spec.count, desc=f"self-instruct questions ({len(seeds)} seeds)", unit="question") as bar:
        path = write_self_instruct_questions(target, tokenizer, seeds, directory, spec, max(args.generate_batch, 16),
                                             lambda done, _: bar.update(done - bar.n))
    prompts = load_prompts(tokenizer, [str(path)])
    print(f"[self-instruct: {len(prompts)} questions kept of {spec.count} in {path}]", file=sys.stderr)
    if not prompts:
        return []
    feature_spec = FeatureSpec(target_fingerprint(target), (str(path),), len(prompts), args.max_new_tokens,
                               args.max_len, args.generate_batch)
    return _cached_sequences(target, tokenizer, prompts, directory / "features", feature_spec,
                             "self-instruct continuations")


def _cached_sequences(target, tokenizer, prompts, directory: Path, spec, description: str):
    """build_features (generating only the missing shards) under a progress bar, then the sequences of every shard."""
    from tqdm import tqdm

    from specdec.train.data import build_features, load_sequences

    with tqdm(total=len(prompts) * spec.samples, desc=description, unit="sequence") as bar:
        shards = build_features(target, tokenizer, prompts, directory, spec, lambda done, _: bar.update(done - bar.n))
    return load_sequences(shards)


def _evaluate(trainer, held_out, depth: int) -> dict:
    from specdec.train.trainer import chain_acceptance

    result = chain_acceptance(trainer.head, trainer.parts, held_out, depth)
    summary = {"sequences": len(held_out), "starts": result.starts,
               "depth_accuracy": [round(a, 4) for a in result.depth_accuracy],
               "chain_acceptance": [round(a, 4) for a in result.chain_acceptance],
               "mean_accepted_length": round(result.mean_accepted_length, 3)}
    print(f"[held-out greedy chains, k = {len(result.chain_acceptance)}: accepted at depth "
          f"{', '.join(f'{a:.2f}' for a in result.chain_acceptance)}; mean accepted length "
          f"{result.mean_accepted_length:.2f} over {result.starts} starts]", file=sys.stderr)
    return summary


def _train(args, target, sequences, out: Path):
    from tqdm import tqdm

    from specdec.heads.modules import TargetParts
    from specdec.train.trainer import Trainer, TrainSettings, draft_vocabulary

    config = head_config(args, target)
    initial = _initial_head(args.init_from, config)
    draft_token_ids = (initial.draft_token_ids if initial is not None
                       else draft_vocabulary(sequences, target.config.vocab_size, config.draft_vocab_size))
    parts = TargetParts.from_target(target, draft_token_ids)
    settings = TrainSettings(steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr, seed=args.seed,
                             time_limit_s=args.time_limit_min * 60 if args.time_limit_min else None,
                             unroll_steps=args.unroll_steps, feature_weight=args.feature_weight,
                             token_weight=args.token_weight, loss_positions=args.loss_positions,
                             precision=_precision(args.precision, target.device))
    trainer = Trainer(config, parts, sequences, settings, checkpoint=out.with_suffix(".ckpt"),
                      initial_state=initial.state if initial is not None else None)
    with tqdm(total=args.steps, initial=trainer.state.step, desc=f"training {args.method}", unit="step") as bar:
        def on_step(record) -> None:
            bar.set_postfix(loss=f"{record.loss:.3f}", acc=f"{record.accuracy:.2f}", refresh=False)
            bar.update(1)

        finished = trainer.run(on_step)
    return trainer, finished


def _initial_head(path: str | None, config):
    """The --init-from head file, checked to have the configuration this run trains (None without it)."""
    from specdec.heads.config import load_head

    if path is None:
        return None
    initial = load_head(path)
    if initial.config != config:
        differing = sorted(name for name, value in vars(config).items() if getattr(initial.config, name) != value)
        raise ValueError(f"--init-from {path} is a head of another configuration ({', '.join(differing)} differ)")
    return initial


def _precision(requested: str, device) -> str:
    from specdec.train.trainer import bf16_supported

    if requested != "auto":
        return requested
    return "bf16" if bf16_supported(device) else "fp32"


def head_config(args, target):
    from specdec.heads.config import HeadConfig, target_fingerprint

    c = target.config
    common = dict(
        method=args.method,
        target_name=str(args.model),
        target_fingerprint=target_fingerprint(target),
        hidden_size=c.hidden_size,
        vocab_size=c.vocab_size,
        draft_vocab_size=min(args.draft_vocab, c.vocab_size),
        embedding_scale=c.embedding_scale,
        final_logit_softcap=c.final_logit_softcap,
        rms_norm_eps=c.rms_norm_eps,
    )
    if args.method == "medusa":
        return HeadConfig(**common, num_medusa_heads=args.medusa_heads)
    intermediate = args.intermediate_size or min(2 * c.hidden_size, c.intermediate_size)
    return HeadConfig(**common, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                      intermediate_size=intermediate, rope_theta=c.rope_theta)


def _plot(trainer, out: Path) -> None:
    from specdec.train.trainer import plot_losses

    if trainer.state.history:
        plot_losses(trainer.state.history, out.with_suffix(".png"),
                    f"{trainer.config.method} head for {trainer.config.target_name}")
