"""Where measured cost profiles live: one JSON file per (model identity, weight format, thread count, machine,
kernel build) under ``$XDG_CACHE_HOME/specdec/costs/`` (``~/.cache/specdec/costs``), see `ProfileKey`; measured at a
model's first use (`load_or_measure`) and re-saved as the engine's timed steps refine them (`ProfileLearner`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specdec.models.layers import resolved_weight_format
from specdec.engine.draft_length.costs import (MAX_PROFILE_ROWS, ContextCosts, CostProfile, CostSamples, ForwardCosts,
                                               folded)
from specdec.engine.draft_length.measure import (CONTINUE_BUDGET_SHARE, PROFILE_BUDGET_S, has_count_to_continue,
                                                 long_context_for, measure_cost_profile)


def machine_name(device: str | torch.device = "cpu") -> str:
    """The CPU model string (and the GPU's name when profiling on one)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_identity(name_or_path: str) -> str:
    """Catalogue models: name + the pinned sha256 of their file. Other paths: name + a fingerprint of
    (resolved path, size, mtime) of the file or the directory's files (hashing GBs at every start is too slow)."""
    from specdec.models.catalog import CATALOG

    if name_or_path in CATALOG:
        return f"{name_or_path}@sha256:{CATALOG[name_or_path].sha256}"
    path = Path(name_or_path).expanduser().resolve()
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        if file.is_file():
            stat = file.stat()
            digest.update(f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return f"{path.name}@files:{digest.hexdigest()[:16]}"


@dataclass(frozen=True)
class ProfileKey:
    model: str  # model_identity(...)
    weight_format: str
    threads: int
    machine: str
    kernels: str = "torch"  # kernels.ops.kernel_build_id(): a rebuilt kernel measures afresh
    protocol: int = 4  # how costs are measured (4: budgeted samples, learned online): a new one measures afresh

    @classmethod
    def current(cls, model_name_or_path: str, weight_format: str, device: str | torch.device = "cpu") -> ProfileKey:
        """The key of this process's profile; weight_format as the layers load it on this kernel path
        (`resolved_weight_format`: auto is q5 on the avx2 path), so a profile measured on other layers is not reused."""
        from specdec.kernels.ops import kernel_build_id

        return cls(model_identity(model_name_or_path), resolved_weight_format(weight_format), torch.get_num_threads(),
                   machine_name(device), kernel_build_id())

    def filename(self) -> str:
        digest = hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", self.model.split("@")[0])[:60]
        return f"{stem}-{self.weight_format}-{self.threads}t-{digest}.json"


FOREIGN_LOAD_LIMIT_CORES = 0.25  # other processes' CPU use above which a measurement is not saved


def _machine_busy_s() -> float | None:
    """Seconds of CPU time all processes have used since boot (/proc/stat: every state but idle and iowait), or
    None where there is no /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(value) for value in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    """The live processes pid started, and theirs (/proc/PID/task/TID/children), e.g. tensor-parallel ranks."""
    found = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            children = [int(child) for child in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


def _process_cpu_s(pid: int) -> float:
    """utime + stime of a live process (/proc/PID/stat), 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14 and 15 of stat(5)


def _own_cpu_s() -> float:
    """CPU time of this process and the live processes it started (its tensor-parallel ranks use the CPU for it)."""
    times = os.times()
    return times.user + times.system + sum(_process_cpu_s(pid) for pid in _descendants(os.getpid()))


@dataclass
class ForeignLoad:
    """How many cores other processes kept busy since `start` (the machine's CPU time less this process's, over the
    wall time). A cost measured while other processes ran describes the contention, not the machine: a policy that
    learnt T(n) from such a profile stops drafting on an idle machine too. So a measurement with more than
    FOREIGN_LOAD_LIMIT_CORES of foreign load is used by this process but not saved."""

    machine_busy_s: Callable[[], float | None] | None = None  # None: read /proc/stat (`_machine_busy_s`)
    own_cpu_s: Callable[[], float] = _own_cpu_s
    clock: Callable[[], float] = time.monotonic
    started: tuple[float | None, float, float] | None = None  # (machine busy s, own cpu s, clock) at start

    def start(self) -> ForeignLoad:
        self.started = (self._read_machine_busy_s(), self.own_cpu_s(), self.clock())
        return self

    def _read_machine_busy_s(self) -> float | None:
        return (self.machine_busy_s or _machine_busy_s)()

    def cores(self) -> float | None:
        """Foreign cores since start (None: unknown — no /proc/stat, not started, or no time passed)."""
        if self.started is None:
            return None
        busy_then, own_then, wall_then = self.started
        busy_now, wall = self._read_machine_busy_s(), self.clock() - wall_then
        if busy_then is None or busy_now is None or wall <= 0:
            return None
        return max(0.0, (busy_now - busy_then) - (self.own_cpu_s() - own_then)) / wall

    def too_busy(self) -> bool:
        cores = self.cores()
        return cores is not None and cores > FOREIGN_LOAD_LIMIT_CORES


def costs_dir() -> Path:
    """``$XDG_CACHE_HOME/specdec/costs`` (``~/.cache/specdec/costs`` when unset)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "specdec" / "costs"


def save_profile(key: ProfileKey, profile: CostProfile, extra: dict | None = None) -> Path:
    """Writes the profile under key (atomically: a reader sees the old file or the new one). With samples, those
    are what a later load reads back; forward_s and context are their curves, for people and other tools."""
    path = costs_dir() / key.filename()
    path.parent.mkdir(parents=True, exist_ok=True)
    context = profile.context
    payload = {"key": dataclasses.asdict(key), "forward_s": list(profile.forward.seconds),
               "context": None if context is None else {"base_context": context.base_context,
                                                        "per_token_s": list(context.per_token_s)},
               "samples": None if profile.samples is None else profile.samples.to_json(),
               "saved_at": time.time(), **(extra or {})}
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(payload, indent=2))
    os.replace(partial, path)
    return path


def load_profile(key: ProfileKey) -> CostProfile | None:
    """The cached profile for exactly this key, or None (missing, unreadable or for another key)."""
    path = costs_dir() / key.filename()
    try:
        payload = json.loads(path.read_text())
        if payload["key"] != dataclasses.asdict(key):
            return None
        if payload.get("samples") is not None:
            return CostSamples.from_json(payload["samples"]).profile()
        context = payload.get("context")
        return CostProfile(ForwardCosts(tuple(float(s) for s in payload["forward_s"])),
                           None if context is None else ContextCosts(int(context["base_context"]),
                                                                     tuple(float(s) for s in context["per_token_s"])))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def load_or_measure(model, key: ProfileKey, budget_s: float = PROFILE_BUDGET_S) -> CostProfile:
    """The cached profile for key, else one measured now within budget_s (`measure_cost_profile`; one line on stderr
    says what and how long) and cached; an unwritable cache keeps the measurement for this process only. A cached
    profile whose budget ran out before some row counts (or context costs) it wants — or left them with fewer than
    MIN_PAIRS pairs — is continued within CONTINUE_BUDGET_SHARE of the budget, when one of them can fit (so each
    start is bounded, and the profile completes over a few starts)."""
    cached = load_profile(key)
    known = None if cached is None else cached.samples
    if known is not None:
        budget_s *= CONTINUE_BUDGET_SHARE
    if cached is not None and (known is None or not has_count_to_continue(
            known, long_context_for(model, MAX_PROFILE_ROWS, known.base_context), budget_s)):
        return cached
    name = key.model.split("@")[0]
    what = "profiling the forward costs of" if known is None else "continuing the cost profile of"
    print(f"[{what} {name} (at most {budget_s:g} s; once per model, machine and kernel build, then refined from the "
          "timed steps) ...", end="", file=sys.stderr, flush=True)
    started, foreign = time.perf_counter(), ForeignLoad().start()
    try:
        run = measure_cost_profile(model, budget_s, known=known)
    except BaseException:
        print(" failed]", file=sys.stderr)
        raise
    print(f" {time.perf_counter() - started:.1f} s: {run.summary()}]", file=sys.stderr)
    profile = run.samples.profile()
    if foreign.too_busy():
        print(f"[other processes kept {foreign.cores():.2f} cores busy while profiling: the profile serves this "
              "process and is not saved, so the next start measures again]", file=sys.stderr)
        return profile
    try:
        save_profile(key, profile)
    except OSError:
        pass
    return profile


@dataclass
class ProfileLearner:
    """Refines a profile's T(n) with the target forwards the engine times, and keeps its cached file up to date.

    The profile measured at first use times a few row counts within a budget (`profile_costs`); the rest of T(n) is
    bounded from them (`RowSamples.curve`). Every decode step measures T at its row count n, less what its
    sequences' contexts add (`ContextCosts`); a step whose context part is over `max_context_share` of it says more
    about the context than about T(n), and is left out. A one-row step is folded into T(1), the level. A step of n
    rows is folded into T(n) / T(1), against the level of the moment: the median of the last `recent` one-row
    steps, if the latest of them is at most `level_horizon` steps old (otherwise the step is not learned from). So
    the profile's shape — measured in pairs with T(1) — is compared with T(1) measured at about the same time, and a
    slow spell of the machine moves the level, not the shape (measured: a profile timed in a compile's slow spell
    with T(1) then learned at an idle 100 ms left T(2) at 7x T(1), and the policy never drafted again). A count the
    policy reaches for the first time (the conservative bound is what lets it try one at all) replaces the bound by a
    measurement; the knee and the draft lengths follow. Each value is a running mean, then an EMA of weight
    `weight_floor` per step. Every `save_every` new measurements (at most every `min_save_interval_s`), the samples
    are written back under `key`, so the next process starts from them.

    Where the steps never verify one row (drafts that always hit), nothing tells the shape from the level: T(n) /
    T(1) stays as profiled, and the policy's calibration (`CostCalibration`) follows the level.
    """

    samples: CostSamples
    key: ProfileKey | None = None  # None: not saved
    weight_floor: float = 1 / 32
    max_jump: float = 3.0
    max_context_share: float = 0.5
    recent: int = 5
    level_horizon: int = 16
    save_every: int = 32
    min_save_interval_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    unsaved: int = 0
    last_save: float | None = None
    recent_one_row_s: list[float] = field(default_factory=list)  # the last `recent` one-row steps' seconds
    steps_since_one_row: int | None = None  # None: no one-row step yet
    foreign_load: ForeignLoad = field(default_factory=lambda: ForeignLoad().start())  # since the last save is due

    def observe(self, rows: int, target_s: float, context_s: float = 0.0) -> bool:
        """A target forward of `rows` rows took target_s seconds, context_s of which the context costs account for.
        Returns whether T(n) changed."""
        if self.steps_since_one_row is not None:
            self.steps_since_one_row += 1
        if not target_s > 0 or not 0 <= context_s <= self.max_context_share * target_s:
            return False
        seconds, samples = target_s - context_s, self.samples
        if rows == 1:
            self.recent_one_row_s = [*self.recent_one_row_s[1 - self.recent:], seconds]
            self.steps_since_one_row = 0
            samples.one_row_s = folded(samples.one_row_s, samples.one_row_count, seconds, self.weight_floor,
                                       self.max_jump)
            samples.one_row_count += 1
        elif self.steps_since_one_row is not None and self.steps_since_one_row <= self.level_horizon:
            samples.forward.observe(rows, seconds / statistics.median(self.recent_one_row_s), self.weight_floor,
                                    self.max_jump)
        else:
            return False
        self.unsaved += 1
        return True

    def profile(self) -> CostProfile:
        return self.samples.profile()

    def save_if_due(self) -> Path | None:
        """Writes the samples back under key when save_every measurements are unsaved (and the last save is at least
        min_save_interval_s ago), unless other processes kept the machine busy since the last time a save was due
        (`ForeignLoad`: the file keeps what quiet steps taught; the running mean forgets the busy steps as quiet ones
        come); an unwritable cache keeps them for this process."""
        now = self.clock()
        if (self.key is None or self.unsaved < self.save_every
                or (self.last_save is not None and now - self.last_save < self.min_save_interval_s)):
            return None
        busy, self.foreign_load = self.foreign_load.too_busy(), self.foreign_load.start()
        self.unsaved, self.last_save = 0, now
        if busy:
            return None
        try:
            return save_profile(self.key, self.samples.profile())
        except OSError:
            return None

