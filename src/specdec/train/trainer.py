"""Training an EAGLE head or Medusa heads on cached target features, with checkpoint/resume.

Losses (per position, averaged over real positions of the batch):
  EAGLE   smooth-L1(predicted h(t+1), h(t+1)) + 0.1 * KL(target distribution of token t+2 over the draft
          vocabulary, head distribution from the predicted state) -- EAGLE-1's weighting; with
          unroll_steps > 1 the same loss for each training-time-test step s (the head fed its own predictions),
          weighted 0.8^(s-1).
  Medusa  sum_i 0.8^(i-1) * KL(target distribution of token t+1+i, head i's distribution from h(t)).
The target distributions are softmax(draft lm_head rows . h): the head learns the target's own predictions
(the data are its greedy continuations), restricted to the draft vocabulary.
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

EAGLE_CE_WEIGHT = 0.1
EAGLE_STEP_DECAY = 0.8  # weight of training-time-test step s: 0.8^(s-1)
MEDUSA_DECAY = 0.8


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


def sample_batch(sequences: list[TrainingSequence], batch_tokens: int, generator: torch.Generator) -> list[TrainingSequence]:
    order = torch.randperm(len(sequences), generator=generator).tolist()
    batch, total = [], 0
    for index in order:
        batch.append(sequences[index])
        total += len(sequences[index].token_ids)
        if total >= batch_tokens:
            break
    return batch


def pad_batch(batch: list[TrainingSequence], parts: TargetParts, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> embeds [B, T, hidden] (token t), hidden [B, T, hidden] (state t), mask [B, T] bool (real positions)."""
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
    return embeds, hidden, mask


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """[..., V] each -> [...]: KL(softmax(target_logits) || softmax(logits)), i.e. the cross-entropy minus the
    target's entropy (same gradient; 0 when the head matches the target)."""
    target_log_probs = torch.log_softmax(target_logits, -1)
    return (target_log_probs.exp() * (target_log_probs - torch.log_softmax(logits, -1))).sum(-1)


def eagle_loss(head: EagleHead, parts: TargetParts, embeds, hidden, mask, unroll_steps: int = 1) -> tuple[torch.Tensor, float]:
    """Pairs (h(t), embed(t+1)) predict h(t+1); shapes as pad_batch. -> (loss, top-1 accuracy of the first draft).

    unroll_steps > 1 adds the training-time test (EagleHead.forward_unrolled): step s, fed the head's own
    predictions as drafting feeds them, is scored against the same targets with weight EAGLE_STEP_DECAY^(s-1).
    """
    predictions = head.forward_unrolled(embeds[:, 1:], hidden[:, :-1], unroll_steps)  # each [B, T-1, hidden]
    target = hidden[:, 1:]
    with torch.no_grad():
        target_logits = parts.draft_logits(target)  # [B, T-1, draft vocab]
    total, accuracy = hidden.new_zeros(()), 0.0
    for step, predicted in enumerate(predictions, start=1):
        valid = mask[:, 1:].clone()  # [B, T-1]
        valid[:, : step - 1] = False  # step s has no draft history before position s - 1
        regression = F.smooth_l1_loss(predicted, target, reduction="none").mean(-1)  # [B, T-1]
        logits = parts.draft_logits(predicted)
        ce = soft_cross_entropy(logits, target_logits)
        count = valid.sum().clamp(min=1)
        total = total + EAGLE_STEP_DECAY ** (step - 1) * ((regression + EAGLE_CE_WEIGHT * ce) * valid).sum() / count
        if step == 1:
            accuracy = float(((logits.argmax(-1) == target_logits.argmax(-1)) & valid).sum() / count)
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


def learning_rate(settings: TrainSettings, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class Trainer:
    """One head, its optimizer and TrainState; `run` trains to settings.steps, checkpointing as it goes."""

    def __init__(self, config: HeadConfig, parts: TargetParts, sequences: list[TrainingSequence],
                 settings: TrainSettings, checkpoint: Path | None = None) -> None:
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

    def _resume(self, path: Path) -> None:
        saved = torch.load(path, weights_only=False)
        if saved["config"] != asdict(self.config) or not torch.equal(saved["draft_token_ids"], self.parts.draft_token_ids.cpu()):
            raise ValueError(f"checkpoint {path} belongs to another head configuration or data; delete it to start over")
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
        embeds, hidden, mask = pad_batch(batch, self.parts, self.device)
        self.head.train()
        if self.config.method == "eagle":
            loss, accuracy = eagle_loss(self.head, self.parts, embeds, hidden, mask, self.settings.unroll_steps)
        else:
            loss, accuracy = medusa_loss(self.head, self.parts, embeds, hidden, mask)
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
    smooth = [sum(r.loss for r in history[max(0, i - window + 1) : i + 1]) / len(history[max(0, i - window + 1) : i + 1])
              for i in range(len(history))]
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
