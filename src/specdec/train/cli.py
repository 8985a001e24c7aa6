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
    parser.add_argument("--time-limit-min", type=float, default=None, help="stop this run's training after this many minutes")
    parser.add_argument("--batch-tokens", type=int, default=2048, help="positions per optimizer step")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--draft-vocab", type=int, default=8192, help="lm_head rows the head drafts over (most frequent tokens)")
    parser.add_argument("--intermediate-size", type=int, default=None, help="EAGLE layer MLP width (default min(2 x hidden, target's))")
    parser.add_argument("--medusa-heads", type=int, default=4)
    parser.add_argument("--unroll-steps", type=int, default=3,
                        help="EAGLE: draft steps trained per position on the head's own predictions (training-time "
                        "test); 1 = teacher-forced only")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="greedy continuation length per prompt")
    parser.add_argument("--max-len", type=int, default=1024, help="longest training sequence (prompt + continuation)")
    parser.add_argument("--max-prompts", type=int, default=None, help="use N prompts, evenly spaced over the files")
    parser.add_argument("--holdout-every", type=int, default=0, help="leave out every N-th question of each file")
    parser.add_argument("--generate-batch", type=int, default=8, help="prompts generated together (one feature shard)")
    parser.add_argument("--features-dir", default=None, help="feature cache (default: beside --out, shared by methods)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-format", default="q8", choices=["q8", "fp32"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default=None)


def cmd_train_draft(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specdec.heads.config import save_head, target_fingerprint
    from specdec.runtime import configure_threads, default_device, load_model
    from specdec.train.data import FeatureSpec, build_features, load_prompts, load_sequences

    configure_threads(args.threads)
    out = Path(args.out or f"heads/{Path(args.model).stem}-{args.method}.safetensors")
    target, tokenizer = load_model(args.model, args.weight_format, args.device or default_device())
    prompt_files = tuple(args.prompts or DEFAULT_PROMPTS)
    prompts = load_prompts(tokenizer, prompt_files, args.holdout_every, args.max_prompts)
    spec = FeatureSpec(target_fingerprint(target), prompt_files, len(prompts), args.max_new_tokens, args.max_len,
                       args.generate_batch)
    features = Path(args.features_dir or out.parent / f"{Path(args.model).stem}-features")
    started = time.perf_counter()
    with tqdm(total=len(prompts), desc="target continuations", unit="prompt") as bar:
        shards = build_features(target, tokenizer, prompts, features, spec, lambda done, _: bar.update(done - bar.n))
    sequences = load_sequences(shards)
    data_s = time.perf_counter() - started
    num_tokens = sum(len(s.token_ids) for s in sequences)
    print(f"[data: {len(sequences)} sequences, {num_tokens} tokens in {features} ({data_s:.0f} s this run)]", file=sys.stderr)
    trainer, finished = _train(args, target, sequences, out)
    history = trainer.state.history
    tail = history[-20:]
    training = {"prompt_files": list(prompt_files), "sequences": len(sequences), "tokens": num_tokens,
                "steps": trainer.state.step, "train_seconds": round(trainer.state.train_seconds, 1),
                "batch_tokens": args.batch_tokens, "lr": args.lr, "holdout_every": args.holdout_every,
                "max_new_tokens": args.max_new_tokens, "unroll_steps": args.unroll_steps, "device": str(target.device),
                "final_loss": sum(r.loss for r in tail) / len(tail), "final_accuracy": sum(r.accuracy for r in tail) / len(tail),
                "first_loss": history[0].loss}
    save_head(out, trainer.config, trainer.head.state_dict(), trainer.parts.draft_token_ids, training)
    _plot(trainer, out)
    print(json.dumps(training), file=sys.stderr)
    state = "done" if finished else f"stopped at step {trainer.state.step}/{args.steps}; rerun to resume"
    print(f"[{args.method} head written to {out} ({state})]", file=sys.stderr)
    return 0


def _train(args, target, sequences, out: Path):
    from tqdm import tqdm

    from specdec.heads.modules import TargetParts
    from specdec.train.trainer import Trainer, TrainSettings, draft_vocabulary

    config = head_config(args, target)
    parts = TargetParts.from_target(target, draft_vocabulary(sequences, target.config.vocab_size, config.draft_vocab_size))
    settings = TrainSettings(steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr, seed=args.seed,
                             time_limit_s=args.time_limit_min * 60 if args.time_limit_min else None,
                             unroll_steps=args.unroll_steps)
    trainer = Trainer(config, parts, sequences, settings, checkpoint=out.with_suffix(".ckpt"))
    with tqdm(total=args.steps, initial=trainer.state.step, desc=f"training {args.method}", unit="step") as bar:
        def on_step(record) -> None:
            bar.set_postfix(loss=f"{record.loss:.3f}", acc=f"{record.accuracy:.2f}", refresh=False)
            bar.update(1)

        finished = trainer.run(on_step)
    return trainer, finished


def head_config(args, target):
    from specdec.heads.config import HeadConfig, target_fingerprint

    c = target.config
    common = dict(method=args.method, target_name=str(args.model), target_fingerprint=target_fingerprint(target),
                  hidden_size=c.hidden_size, vocab_size=c.vocab_size, draft_vocab_size=min(args.draft_vocab, c.vocab_size),
                  embedding_scale=c.embedding_scale, final_logit_softcap=c.final_logit_softcap, rms_norm_eps=c.rms_norm_eps)
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
