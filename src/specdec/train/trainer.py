"""Training an EAGLE head or Medusa heads on cached target features, with checkpoint/resume.

Losses (per position, averaged over the scored positions of the batch):
  EAGLE   feature_weight * smooth-L1(predicted h(t+1), h(t+1)) + token_weight * KL(target distribution of token
          t+2 over the draft vocabulary, head distribution from the predicted state) -- 1.0 and 0.1 by default,
          EAGLE-1's weighting; with
          unroll_steps > 1 the same loss for each training-time-test step s (the head fed its own predictions),
          weighted 0.8^(s-1).
  Medusa  sum_i 0.8^(i-1) * KL(target distribution of token t+1+i, head i's distribution from h(t)).
The target distributions are softmax(draft lm_head rows . h): the head learns the target's own predictions
(the data are its continuations), restricted to the draft vocabulary. The positions scored are every position
or only those whose target token is in the continuation (`loss_positions`).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from specdec.heads.config import HeadConfig
from specdec.heads.modules import EagleHead, MedusaHeads, TargetParts, build_head
from specdec.train.data import TrainingSequence

EAGLE_STEP_DECAY = 0.8  # weight of training-time-test step s: 0.8^(s-1)
MEDUSA_DECAY = 0.8
LOSS_POSITIONS = ("all", "continuation")
PRECISIONS = ("fp32", "bf16")


def bf16_supported(device: torch.device) -> bool:
    """Whether bf16 autocast runs at bf16 speed here (CUDA with bf16, or a CPU with AVX512-BF16 or AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 400
    batch_tokens: int = 2048  # sequences per step are drawn until this many positions
    lr: float = 5e-4
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 25
    time_limit_s: float | None = None  # stop (and save) after this much training time in this run
    unroll_steps: int = 1  # EAGLE: draft steps trained per position (training-time test); 1 = teacher-forced only
    feature_weight: float = 1.0  # EAGLE: weight of the smooth-L1 loss on the predicted state
    token_weight: float = 0.1  # EAGLE: weight of the KL loss on the draft distribution (EAGLE-1: 0.1)
    loss_positions: str = "all"  # "all", or "continuation": only positions whose next token the target generated
    precision: str = "fp32"  # "fp32", or "bf16": the forward and backward under bf16 autocast (weights, optimizer
    #                          state and losses stay fp32); about twice as fast on CPUs with AVX512-BF16

    def __post_init__(self) -> None:
        if self.loss_positions not in LOSS_POSITIONS:
            raise ValueError(f"loss_positions must be one of {', '.join(LOSS_POSITIONS)}, got {self.loss_positions!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.feature_weight < 0 or self.token_weight < 0 or self.feature_weight + self.token_weight == 0:
            raise ValueError(f"loss weights must be >= 0 and not both 0 (feature {self.feature_weight}, "
                             f"token {self.token_weight})")


@dataclass(frozen=True)
class StepLoss:
    step: int
    loss: float
    accuracy: float  # top-1 agreement of the head's first draft with the target, on this batch


@dataclass
class TrainState:
    """What a checkpoint holds besides the module and optimizer states."""

    step: int = 0
    train_seconds: float = 0.0
    history: list[StepLoss] = field(default_factory=list)


def draft_vocabulary(sequences: list[TrainingSequence], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the data (ties: lower id), sorted -> [size] int64 (FR-Spec)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for sequence in sequences:
        counts += torch.bincount(sequence.token_ids, minlength=vocab_size)
    rank = counts * vocab_size - torch.arange(vocab_size)  # by count, then by lower id
    return torch.argsort(rank, descending=True)[:size].sort().values


def sample_batch(
    sequences: list[TrainingSequence], batch_tokens: int, generator: torch.Generator
) -> list[TrainingSequence]:
    order = torch.randperm(len(sequences), generator=generator).tolist()
    batch, total = [], 0
    for index in order:
        batch.append(sequences[index])
        total += len(sequences[index].token_ids)
        if total >= batch_tokens:
            break
    return batch


def pad_batch(batch: list[TrainingSequence], parts: TargetParts, device, loss_positions: str = "all",
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> embeds [B, T, hidden] (token t), hidden [B, T, hidden] (state t), mask [B, T] bool: the positions a loss
    may score as targets (real positions; with loss_positions "continuation", only those after the prompt)."""
    length = max(len(s.token_ids) for s in batch)
    hidden_size = batch[0].hidden.shape[1]
    embeds = torch.zeros(len(batch), length, hidden_size, device=device)
    hidden = torch.zeros(len(batch), length, hidden_size, device=device)
    mask = torch.zeros(len(batch), length, dtype=torch.bool, device=device)
    for row, sequence in enumerate(batch):
        n = len(sequence.token_ids)
        embeds[row, :n] = parts.embed(sequence.token_ids.to(device))
        hidden[row, :n] = sequence.hidden.to(device).float()
        mask[row, :n] = True
        if loss_positions == "continuation":
            mask[row, : sequence.prompt_length] = False
    return embeds, hidden, mask


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """[..., V] each -> [...]: KL(softmax(target_logits) || softmax(logits)), i.e. the cross-entropy minus the
    target's entropy (same gradient; 0 when the head matches the target)."""
    target_log_probs = torch.log_softmax(target_logits, -1)
    return (target_log_probs.exp() * (target_log_probs - torch.log_softmax(logits, -1))).sum(-1)


def eagle_loss(head: EagleHead, parts: TargetParts, embeds, hidden, mask, unroll_steps: int = 1,
               feature_weight: float = 1.0, token_weight: float = 0.1) -> tuple[torch.Tensor, float]:
    """Pairs (h(t), embed(t+1)) predict h(t+1); shapes as pad_batch. -> (loss, top-1 accuracy of the first draft).

    unroll_steps > 1 adds the training-time test (EagleHead.forward_unrolled): step s, fed the head's own
    predictions as drafting feeds them, is scored against the same targets with weight EAGLE_STEP_DECAY^(s-1).
    """
    predictions = head.forward_unrolled(embeds[:, 1:], hidden[:, :-1], unroll_steps)  # each [B, T-1, hidden]
    target = hidden[:, 1:]
    total, accuracy = hidden.new_zeros(()), 0.0
    for step, predicted in enumerate(predictions, start=1):
        valid = mask[:, 1:].clone()  # [B, T-1]
        valid[:, : step - 1] = False  # step s has no draft history before position s - 1
        if not valid.any():
            continue
        scored, wanted = predicted[valid], target[valid]  # [N, hidden]: only the scored rows reach the output layer
        with torch.no_grad():
            target_logits = parts.draft_logits(wanted)  # [N, draft vocab]
        logits = parts.draft_logits(scored)  # [N, draft vocab]
        regression = F.smooth_l1_loss(scored, wanted, reduction="none").mean(-1)  # [N]
        ce = soft_cross_entropy(logits, target_logits)  # [N]
        total = total + EAGLE_STEP_DECAY ** (step - 1) * (feature_weight * regression + token_weight * ce).mean()
        if step == 1:
            accuracy = float((logits.argmax(-1) == target_logits.argmax(-1)).float().mean())
    return total, accuracy


def medusa_loss(heads: MedusaHeads, parts: TargetParts, embeds, hidden, mask) -> tuple[torch.Tensor, float]:
    """Head i (1-based) on h(t) learns the target distribution at t+i (of token t+1+i). -> (loss, head-1 accuracy)."""
    predicted = heads(hidden)  # [heads, B, T, hidden]
    total, accuracy = hidden.new_zeros(()), 0.0
    for i in range(1, predicted.shape[0] + 1):
        if hidden.shape[1] <= i:
            break
        valid = mask[:, i:]  # positions t with t + i real
        with torch.no_grad():
            target_logits = parts.draft_logits(hidden[:, i:])  # [B, T-i, draft vocab]
        logits = parts.draft_logits(predicted[i - 1, :, :-i])
        count = valid.sum().clamp(min=1)
        total = total + MEDUSA_DECAY ** (i - 1) * (soft_cross_entropy(logits, target_logits) * valid).sum() / count
        if i == 1:
            accuracy = float(((logits.argmax(-1) == target_logits.argmax(-1)) & valid).sum() / count)
    return total, accuracy


@dataclass(frozen=True)
class ChainAcceptance:
    """Greedy chain drafts of depth 1..k from every continuation position of some sequences, checked against the
    target's own next tokens (the data are its greedy continuations, so a draft is accepted exactly when it equals
    the token there): what speculative decoding with this head would accept, without running the target.

    starts: draft positions scored; depth_accuracy[j-1]: drafts at depth j equal to the target's token (whatever
    came before); chain_acceptance[j-1]: starts whose first j drafts are all accepted.
    """

    starts: int
    depth_accuracy: tuple[float, ...]
    chain_acceptance: tuple[float, ...]

    @property
    def mean_accepted_length(self) -> float:
        """Expected tokens per verify step with k = len(chain_acceptance): 1 + the expected accepted drafts."""
        return 1.0 + sum(self.chain_acceptance)


@torch.no_grad()
def chain_acceptance(head: torch.nn.Module, parts: TargetParts, sequences: list[TrainingSequence], depth: int,
                     batch_tokens: int = 4096) -> ChainAcceptance:
    """The head's ChainAcceptance at draft depths 1..depth (Medusa: at most its number of heads) on `sequences`."""
    if isinstance(head, MedusaHeads):
        depth = min(depth, head.config.num_medusa_heads)
    starts, correct_at, chains = 0, [0] * depth, [0] * depth
    for batch in _token_batches(sequences, batch_tokens):
        correct, valid_start = draft_correctness(head, parts, batch, depth)  # [depth, B, T], [B, T]
        alive = valid_start.clone()
        for j in range(depth):
            alive &= correct[j]
            correct_at[j] += int(correct[j].sum())
            chains[j] += int(alive.sum())
        starts += int(valid_start.sum())
    scale = 1.0 / max(1, starts)
    return ChainAcceptance(starts, tuple(c * scale for c in correct_at), tuple(c * scale for c in chains))


@torch.no_grad()
def draft_correctness(head: torch.nn.Module, parts: TargetParts, batch: list[TrainingSequence], depth: int,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain drafts from every start of a batch -> correct [depth, B, T] bool (the depth-j draft from
    start u equals token u + 1 + j) and valid_start [B, T] bool (u in the continuation: prompt length - 1 <= u,
    and token u + 2 exists). A chain starting at u drafts from the pair (h(u), token u + 1), as the engine does
    right after committing token u + 1. EAGLE's depth-j draft is the training-time-test step j at position
    u + j - 1, which reads exactly what a chain draft reads (see EagleHead.forward_unrolled); Medusa head j
    drafts from h(u)."""
    head.eval()
    device = parts.draft_lm_head.device
    embeds, hidden, _ = pad_batch(batch, parts, device)
    length = hidden.shape[1]
    tokens = torch.full((len(batch), length + depth + 1), -1, dtype=torch.int64, device=device)  # [B, T + pad]
    valid_start = torch.zeros(len(batch), length, dtype=torch.bool, device=device)  # [B, T]
    for row, sequence in enumerate(batch):
        n = len(sequence.token_ids)
        tokens[row, :n] = sequence.token_ids.to(device)
        valid_start[row, max(0, sequence.prompt_length - 1) : max(0, n - 2)] = True
    if isinstance(head, EagleHead):
        steps = head.forward_unrolled(embeds[:, 1:], hidden[:, :-1], depth)  # each [B, T-1, hidden]
        states = [F.pad(step[:, j:], (0, 0, 0, j + 1)) for j, step in enumerate(steps)]  # each [B, T, hidden]
    else:
        states = list(head(hidden).unbind(0))[:depth]  # each [B, T, hidden]
    correct = (
        torch.stack(
            [
                parts.draft_token_ids[parts.draft_logits(state).argmax(-1)] == tokens[:, 1 + j : 1 + j + length]
                for j, state in enumerate(states, start=1)
            ]
        )
        & valid_start
    )  # [depth, B, T]
    return correct, valid_start


def _token_batches(sequences: list[TrainingSequence], batch_tokens: int):
    batch, total = [], 0
    for sequence in sequences:
        batch.append(sequence)
        total += len(sequence.token_ids)
        if total >= batch_tokens:
            yield batch
            batch, total = [], 0
    if batch:
        yield batch


def learning_rate(settings: TrainSettings, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class Trainer:
    """One head, its optimizer and TrainState; `run` trains to settings.steps, checkpointing as it goes."""

    def __init__(self, config: HeadConfig, parts: TargetParts, sequences: list[TrainingSequence],
                 settings: TrainSettings, checkpoint: Path | None = None,
                 initial_state: dict[str, torch.Tensor] | None = None) -> None:
        """initial_state: head weights to start from (a warm start) instead of random ones; a checkpoint, when one
        exists, is resumed instead."""
        if not sequences:
            raise ValueError("no training sequences")
        self.config, self.parts, self.sequences, self.settings = config, parts, sequences, settings
        self.device = parts.draft_lm_head.device
        torch.manual_seed(settings.seed)
        self.head = build_head(config).to(self.device)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
        self.state = TrainState()
        self.checkpoint = checkpoint
        if checkpoint is not None and checkpoint.is_file():
            self._resume(checkpoint)
        elif initial_state is not None:
            self.head.load_state_dict(initial_state)

    def _resume(self, path: Path) -> None:
        saved = torch.load(path, weights_only=False)
        if saved["config"] != asdict(self.config) or not torch.equal(
            saved["draft_token_ids"], self.parts.draft_token_ids.cpu()
        ):
            raise ValueError(
                f"checkpoint {path} belongs to another head configuration or data; delete it to start over"
            )
        self.head.load_state_dict(saved["head"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.state = TrainState(saved["step"], saved["train_seconds"], [StepLoss(**row) for row in saved["history"]])

    def save_checkpoint(self) -> None:
        if self.checkpoint is None:
            return
        payload = {"config": asdict(self.config), "draft_token_ids": self.parts.draft_token_ids.cpu(),
                   "head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.state.step,
                   "train_seconds": self.state.train_seconds, "history": [asdict(row) for row in self.state.history]}
        partial = self.checkpoint.with_suffix(".partial")
        torch.save(payload, partial)
        partial.replace(self.checkpoint)

    def train_step(self) -> StepLoss:
        step = self.state.step
        generator = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + step)  # resumable sampling
        batch = sample_batch(self.sequences, self.settings.batch_tokens, generator)
        embeds, hidden, mask = pad_batch(batch, self.parts, self.device, self.settings.loss_positions)
        self.head.train()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.settings.precision == "bf16"):
            if self.config.method == "eagle":
                loss, accuracy = eagle_loss(self.head, self.parts, embeds, hidden, mask, self.settings.unroll_steps,
                                            self.settings.feature_weight, self.settings.token_weight)
            else:
                loss, accuracy = medusa_loss(self.head, self.parts, embeds, hidden, mask)
        loss = loss.float()
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.settings, step)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.settings.grad_clip)
        self.optimizer.step()
        record = StepLoss(step, loss.item(), accuracy)
        self.state.history.append(record)
        self.state.step += 1
        return record

    def run(self, on_step: Callable[[StepLoss], None] | None = None) -> bool:
        """Trains until settings.steps (or the time limit); returns True when all steps are done."""
        started = time.perf_counter()
        try:
            while self.state.step < self.settings.steps:
                tick = time.perf_counter()
                record = self.train_step()
                self.state.train_seconds += time.perf_counter() - tick
                if on_step is not None:
                    on_step(record)
                if self.state.step % self.settings.save_every == 0:
                    self.save_checkpoint()
                limit = self.settings.time_limit_s
                if limit is not None and time.perf_counter() - started >= limit:
                    break
        finally:  # also on KeyboardInterrupt: the next run resumes from here
            self.save_checkpoint()
        return self.state.step >= self.settings.steps


def plot_losses(history: list[StepLoss], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, loss_axis = plt.subplots(figsize=(7, 4))
    steps = [row.step for row in history]
    loss_axis.plot(steps, [row.loss for row in history], color="tab:blue", alpha=0.35, label="loss (per step)")
    window = max(1, len(history) // 20)
    smooth = [
        sum(r.loss for r in history[max(0, i - window + 1) : i + 1]) / len(history[max(0, i - window + 1) : i + 1])
        for i in range(len(history))
    ]
    loss_axis.plot(steps, smooth, color="tab:blue", label=f"loss (mean of {window})")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss")
    accuracy_axis = loss_axis.twinx()
    accuracy_axis.plot(steps, [row.accuracy for row in history], color="tab:orange", alpha=0.5, label="top-1 accuracy")
    accuracy_axis.set_ylabel("top-1 accuracy (first draft)")
    accuracy_axis.set_ylim(0, 1)
    figure.legend(loc="upper right")
    loss_axis.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
