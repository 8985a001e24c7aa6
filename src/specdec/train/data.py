"""Training data for draft heads: the target's greedy continuations of dev prompts and its hidden states.

Each prompt (the first user turn of a Spec-Bench row, or a HumanEval task, through the chat template exactly
as `specdec bench` encodes it) is continued greedily by the target (with n-gram speculation, which is
lossless, to save time). The whole sequence is then run once more through `forward_hidden` and stored as
one row of a shard: tokens [T] and final-normed hidden states [T, hidden] (fp16). Shards are written one
at a time, so an interrupted run resumes at the first missing shard.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors.torch import load_file, save_file

from specdec.cache.kv_cache import KVCache
from specdec.config import SamplingParams
from specdec.engine.batch import ForwardBatch
from specdec.engine.engine import Engine


@dataclass(frozen=True)
class FeatureSpec:
    """What a feature directory holds; a directory made for another spec is refused, not mixed."""

    target_fingerprint: str
    prompt_files: tuple[str, ...]
    num_prompts: int
    max_new_tokens: int
    max_len: int
    shard_size: int


@dataclass(frozen=True)
class TrainingSequence:
    """One training sequence: token_ids [T] int64 and the target's final-normed hidden states [T, hidden]."""

    token_ids: torch.Tensor
    hidden: torch.Tensor


def load_prompts(tokenizer, paths: Sequence[str], holdout_every: int = 0, limit: int | None = None) -> list[list[int]]:
    """First user turn of each question of the dev files, chat-encoded as the benchmark does.

    holdout_every: leave out every n-th question of each file (index % n == n - 1) for held-out evaluation.
    limit: keep this many prompts, evenly spaced over the list (so every file and category stays represented).
    """
    from specdec.bench.datasets import is_held_out, load_questions
    from specdec.bench.runner import encode_chat

    prompts = []
    for path in paths:
        for index, question in enumerate(load_questions(path)):
            if is_held_out(index, holdout_every):
                continue
            prompts.append(encode_chat(tokenizer, [{"role": "user", "content": question.turns[0]}]))
    if limit is None or limit >= len(prompts):
        return prompts
    return [prompts[i * len(prompts) // limit] for i in range(limit)]


def generate_continuations(target, tokenizer, prompts: list[list[int]], max_new_tokens: int, max_len: int,
                           batch_size: int) -> list[list[int]]:
    """prompt + greedy continuation per prompt (truncated to max_len tokens)."""
    from specdec.drafters.ngram import NgramDrafter

    engine = Engine(target, tokenizer, max_num_seqs=batch_size, max_model_len=max_len + 1,
                    drafter=NgramDrafter(4, 2), num_speculative_tokens=4)
    params = SamplingParams(max_tokens=max_new_tokens)
    seqs = [engine.add_request(prompt[: max_len - 1], params) for prompt in prompts]
    while engine.has_unfinished():
        engine.step()
    return [(seq.prompt_token_ids + seq.output_token_ids)[:max_len] for seq in seqs]


def hidden_states(target, sequences: list[list[int]], chunk: int = 512) -> list[torch.Tensor]:
    """The target's final-normed hidden states of every position, per sequence [T_i, hidden] fp32."""
    cache = KVCache(target.config, len(sequences), max(len(s) for s in sequences), target.device,
                    dtype=target.kv_cache_dtype)
    rows: list[list[torch.Tensor]] = [[] for _ in sequences]
    for start in range(0, max(len(s) for s in sequences), chunk):
        live = [i for i, s in enumerate(sequences) if len(s) > start]
        batch = ForwardBatch.build([sequences[i][start : start + chunk] for i in live], [start] * len(live), live,
                                   all_logits=False, device=target.device)
        hidden = target.forward_hidden(batch, cache).hidden  # [rows, hidden]
        for i, part in zip(live, hidden.split(list(batch.row_counts))):
            rows[i].append(part)
    return [torch.cat(parts) for parts in rows]


def build_features(target, tokenizer, prompts: list[list[int]], directory: Path, spec: FeatureSpec,
                   progress: Callable[[int, int], None] | None = None) -> list[Path]:
    """Writes the missing shards of `directory` (resuming); returns every shard path in order."""
    directory.mkdir(parents=True, exist_ok=True)
    _check_or_write_spec(directory, spec)
    shards = []
    for index, start in enumerate(range(0, len(prompts), spec.shard_size)):
        path = directory / f"shard-{index:05d}.safetensors"
        if not path.is_file():
            batch = prompts[start : start + spec.shard_size]
            sequences = generate_continuations(target, tokenizer, batch, spec.max_new_tokens, spec.max_len, len(batch))
            _write_shard(path, sequences, hidden_states(target, sequences))
        shards.append(path)
        if progress is not None:
            progress(min(start + spec.shard_size, len(prompts)), len(prompts))
    return shards


def _check_or_write_spec(directory: Path, spec: FeatureSpec) -> None:
    meta = directory / "features.json"
    wanted = json.loads(json.dumps(asdict(spec)))
    if meta.is_file():
        found = json.loads(meta.read_text())
        if found != wanted:
            differing = sorted(key for key in wanted if found.get(key) != wanted[key])
            raise ValueError(f"feature directory {directory} was made for other settings ({', '.join(differing)} "
                             "differ); pass another --features-dir or delete it")
        return
    meta.write_text(json.dumps(wanted, indent=2) + "\n")


def _write_shard(path: Path, sequences: list[list[int]], hidden: list[torch.Tensor]) -> None:
    tensors = {
        "token_ids": torch.tensor([tok for s in sequences for tok in s], dtype=torch.int64),
        "lengths": torch.tensor([len(s) for s in sequences], dtype=torch.int64),
        "hidden": torch.cat(hidden).to(torch.float16).cpu().contiguous(),  # [sum T, hidden]
    }
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial))
    partial.rename(path)  # a shard exists only once complete


def load_sequences(shards: list[Path]) -> list[TrainingSequence]:
    sequences = []
    for path in shards:
        tensors = load_file(str(path))
        lengths = tensors["lengths"].tolist()
        for token_ids, hidden in zip(tensors["token_ids"].split(lengths), tensors["hidden"].split(lengths)):
            sequences.append(TrainingSequence(token_ids, hidden))
    return sequences
