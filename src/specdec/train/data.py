"""Training data for draft heads: the target's continuations of dev prompts and its hidden states.

Each prompt (the first user turn of a Spec-Bench row, or a HumanEval task, through the chat template exactly
as `specdec bench` encodes it) is continued greedily by the target (with n-gram speculation, which is
lossless, to save time), and optionally `samples - 1` more times by sampling (temperature, a seed per sample):
more of the target's own text from the same prompts. The generating engine runs the target with
`forward_hidden` and hands every committed position's final-normed hidden state to a recorder (the path
EAGLE drafting uses), so no second pass is needed: by row invariance these rows are bit for bit those of one
pass over the finished sequence (tested). Each sequence is one row of a shard: tokens [T], hidden states
[T, hidden] (fp16) and the prompt's length (the loss may skip prompt positions: drafting only ever continues
the target's own text). The last committed token has no hidden row yet (the target has not read it), so a
sequence ends one token before its generation did. Shards are written one at a time, so an interrupted run
resumes at the first missing shard.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors.torch import load_file, save_file

from specdec.config import SamplingParams
from specdec.drafters.base import Drafter, HiddenStateDrafter
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
    samples: int = 1  # continuations per prompt: the greedy one, then samples - 1 sampled ones
    temperature: float = 0.8  # of the sampled continuations


@dataclass(frozen=True)
class TrainingSequence:
    """One training sequence: token_ids [T] int64, the target's final-normed hidden states [T, hidden], and how
    many of the tokens are the prompt (the rest is the target's own continuation; 0 when unknown)."""

    token_ids: torch.Tensor
    hidden: torch.Tensor
    prompt_length: int = 0


def load_prompts(tokenizer, paths: Sequence[str], holdout_every: int = 0, limit: int | None = None,
                 held_out: bool = False) -> list[list[int]]:
    """First user turn of each question of the dev files, chat-encoded as the benchmark does.

    holdout_every: leave out every n-th question of each file (index % n == n - 1) for held-out evaluation;
    held_out: keep only those questions instead (the evaluation prompts).
    limit: keep this many prompts, evenly spaced over the list (so every file and category stays represented).
    """
    from specdec.datasets import is_held_out, load_questions

    prompts = []
    for path in paths:
        for index, question in enumerate(load_questions(path)):
            if is_held_out(index, holdout_every) != held_out:
                continue
            prompts.append(tokenizer.encode_chat([{"role": "user", "content": question.turns[0]}]))
    if limit is None or limit >= len(prompts):
        return prompts
    return [prompts[i * len(prompts) // limit] for i in range(limit)]


class HiddenRecorder(HiddenStateDrafter):
    """Drafts with `inner` and keeps every hidden row the engine hands over, per request, in order: the
    final-normed states of positions 0, 1, ... of the request's committed tokens."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.rows: dict[str, list[torch.Tensor]] = {}

    def add_request(self, request_id, prompt_token_ids, params, noise) -> None:
        self.rows[request_id] = []
        self.inner.add_request(request_id, prompt_token_ids, params, noise)

    def propose(self, request_ids, max_draft_tokens):
        return self.inner.propose(request_ids, max_draft_tokens)

    def constrain(self, request_id, allowed_after) -> None:
        self.inner.constrain(request_id, allowed_after)

    def observe(self, request_id, token_ids) -> None:
        self.inner.observe(request_id, token_ids)

    def remove_request(self, request_id) -> None:
        self.inner.remove_request(request_id)  # the rows stay until taken

    def observe_target_hidden(self, request_id, target_hidden) -> None:
        self.rows[request_id].append(target_hidden.detach().to("cpu", torch.float16))

    def take(self, request_id: str) -> torch.Tensor:
        """The request's recorded rows [n, hidden] fp16, forgotten here."""
        return torch.cat(self.rows.pop(request_id))


def generate_training_sequences(target, tokenizer, prompts: list[list[int]], max_new_tokens: int, max_len: int,
                                batch_size: int, params: Sequence[SamplingParams]) -> list[TrainingSequence]:
    """Continues each prompt (params[i]; max_tokens replaced by max_new_tokens) and keeps the hidden states the
    engine computed on the way: one TrainingSequence per prompt (prompt truncated to max_len - 1 tokens)."""
    from specdec.drafters.ngram import NgramDrafter

    recorder = HiddenRecorder(NgramDrafter(4, 2))
    engine = Engine(target, tokenizer, max_num_seqs=batch_size, max_model_len=max_len + 1, drafter=recorder,
                    num_speculative_tokens=4)
    seqs = [engine.add_request(prompt[: max_len - 1], dataclasses.replace(p, max_tokens=max_new_tokens))
            for prompt, p in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    sequences = []
    for seq in seqs:
        hidden = recorder.take(seq.request_id)[: max_len]  # [T, hidden]: positions 0 .. T - 1
        token_ids = (seq.prompt_token_ids + seq.output_token_ids)[: hidden.shape[0]]
        if len(token_ids) != hidden.shape[0]:
            raise RuntimeError(f"recorded {hidden.shape[0]} hidden rows for {len(token_ids)} tokens")
        sequences.append(TrainingSequence(torch.tensor(token_ids, dtype=torch.int64), hidden,
                                          len(seq.prompt_token_ids)))
    return sequences


def build_features(target, tokenizer, prompts: list[list[int]], directory: Path, spec: FeatureSpec,
                   progress: Callable[[int, int], None] | None = None) -> list[Path]:
    """Writes the missing shards of `directory` (resuming); returns every shard path in order. With spec.samples
    > 1 the greedy continuations of every prompt come first, then each round of sampled ones (sample s of prompt
    i seeded with s * 1_000_003 + i)."""
    directory.mkdir(parents=True, exist_ok=True)
    _check_or_write_spec(directory, spec)
    jobs = [(prompt, SamplingParams()) for prompt in prompts]
    for sample in range(1, spec.samples):
        jobs += [(prompt, SamplingParams(temperature=spec.temperature, seed=sample * 1_000_003 + i))
                 for i, prompt in enumerate(prompts)]
    shards = []
    for index, start in enumerate(range(0, len(jobs), spec.shard_size)):
        path = directory / f"shard-{index:05d}.safetensors"
        if not path.is_file():
            batch = [prompt for prompt, _ in jobs[start : start + spec.shard_size]]
            params = [p for _, p in jobs[start : start + spec.shard_size]]
            _write_shard(path, generate_training_sequences(target, tokenizer, batch, spec.max_new_tokens, spec.max_len,
                                                           len(batch), params))
        shards.append(path)
        if progress is not None:
            progress(min(start + spec.shard_size, len(jobs)), len(jobs))
    return shards


def _check_or_write_spec(directory: Path, spec: FeatureSpec) -> None:
    meta = directory / "features.json"
    wanted = json.loads(json.dumps(asdict(spec)))
    if meta.is_file():
        defaults = {f.name: f.default for f in dataclasses.fields(FeatureSpec) if f.default is not dataclasses.MISSING}
        found = {
            **defaults,
            **json.loads(meta.read_text()),
        }  # a directory written before a field existed had its default
        if found != wanted:
            differing = sorted(key for key in wanted if found.get(key) != wanted[key])
            raise ValueError(f"feature directory {directory} was made for other settings ({', '.join(differing)} "
                             "differ); pass another --features-dir or delete it")
        return
    meta.write_text(json.dumps(wanted, indent=2) + "\n")


def _write_shard(path: Path, sequences: list[TrainingSequence]) -> None:
    tensors = {
        "token_ids": torch.cat([s.token_ids for s in sequences]),
        "lengths": torch.tensor([len(s.token_ids) for s in sequences], dtype=torch.int64),
        "prompt_lengths": torch.tensor([s.prompt_length for s in sequences], dtype=torch.int64),
        "hidden": torch.cat([s.hidden for s in sequences]).to(torch.float16).cpu().contiguous(),  # [sum T, hidden]
    }
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial))
    partial.rename(path)  # a shard exists only once complete


def load_sequences(shards: list[Path]) -> list[TrainingSequence]:
    sequences = []
    for path in shards:
        tensors = load_file(str(path))
        lengths = tensors["lengths"].tolist()
        prompt_lengths = tensors["prompt_lengths"].tolist() if "prompt_lengths" in tensors else [0] * len(lengths)
        for token_ids, hidden, prompt_length in zip(
            tensors["token_ids"].split(lengths), tensors["hidden"].split(lengths), prompt_lengths
        ):
            sequences.append(TrainingSequence(token_ids, hidden, prompt_length))
    return sequences
