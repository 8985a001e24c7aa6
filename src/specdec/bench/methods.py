"""What the benchmark runs: method specs parsed from the command line and the Runner interface.

A Runner generates greedily for one prompt (token ids, batch 1) and returns a Generation. Our methods
(``none``, ``ngram``, ``suffix``, ``draft_model``, ``eagle``, ``medusa``) are SpecdecRunners, one LLM each, all sharing
one loaded
target; peers (HF transformers, llama.cpp, vLLM) implement the same interface in ``peers.py``.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

REFERENCE_METHOD = "none"
KNOWN_METHODS = (REFERENCE_METHOD, "ngram", "suffix", "draft_model", "eagle", "medusa")

# Default speculative config per method (num_speculative_tokens = k).
DEFAULT_METHOD_CONFIGS: dict[str, dict[str, Any]] = {
    # k <= 16: the adaptive policy drafts as deep as the cost profile's knee pays (docs/draft-length.md)
    "ngram": {"num_speculative_tokens": 16, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"num_speculative_tokens": 16},
    "draft_model": {"num_speculative_tokens": 4},
    "eagle": {"num_speculative_tokens": 5},  # "model": the head file is required
    "medusa": {"num_speculative_tokens": 4},
}

# Target -> draft model used by ``draft_model`` when the method gives no "model".
DEFAULT_DRAFTS = {
    "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b-instruct",
}


@dataclass(frozen=True)
class MethodSpec:
    """One of our methods: its row label, its name and the speculative config (None for ``none``)."""

    label: str
    method: str
    config: dict[str, Any] | None = None
    draft_policy: str | None = None  # "adaptive" | "fixed"; None: the run's --draft-policy


@dataclass
class Generation:
    """One greedy generation of one runner. Counters are None where the runner cannot report them."""

    token_ids: list[int]
    wall_s: float  # wall time of the whole request (prefill + decode), measured around the runner's call
    finish_reason: str = ""
    first_token_s: float | None = None  # time from the call to the first new token (prefill + first step)
    verify_steps: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    drafted_per_position: list[int] | None = None
    accepted_per_position: list[int] | None = None
    draft_time_s: float | None = None
    target_time_s: float | None = None
    verify_time_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Runner(ABC):
    """Greedy batch-1 generation for the benchmark.

    label: the row name in the results (``none``, ``ngram``, ``hf:assisted``, ...).
    family: ``specdec`` or the peer's name.
    reference: label of the runner whose output this one must reproduce token for token; None for a reference.
    strict: a mismatch against the reference fails the run (our methods); peers' mismatches are only reported.
    """

    label: str
    family: str
    reference: str | None
    strict: bool

    @abstractmethod
    def generate(self, prompt_token_ids: list[int], max_new_tokens: int) -> Generation:
        """Greedy continuation of the prompt, stopping at the tokenizer's end-of-sequence tokens."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """JSON-able description for the run metadata (method, config, engine)."""


def split_methods(text: str) -> list[str]:
    """Split ``none,ngram:{"a":1,"b":2},suffix`` at commas outside braces."""
    items, depth, current = [], 0, []
    for char in text:
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    items.append("".join(current).strip())
    if depth != 0:
        raise ValueError(f"unbalanced braces in --methods {text!r}")
    return [item for item in items if item]


def parse_methods(texts: list[str], target: str) -> list[MethodSpec]:
    """Method specs from ``--methods`` values; ``none`` is added first when absent (it is the reference).

    Each item is ``name`` or ``name:{json}``; the JSON overrides the method's default speculative config and
    may carry a ``"label"`` for the row name (default: the name, ``name-2`` etc. for repeats) and a
    ``"draft_policy"`` ("adaptive" or "fixed") overriding the run's --draft-policy for this method, so that
    adaptive k and fixed k are measured side by side in one run.
    """
    items = [item for text in texts for item in split_methods(text)]
    specs: list[MethodSpec] = []
    for item in items:
        name, _, config_text = item.partition(":")
        specs.append(_method_spec(name.strip(), config_text.strip(), target, [spec.label for spec in specs]))
    if not any(spec.method == REFERENCE_METHOD for spec in specs):
        specs.insert(0, MethodSpec(REFERENCE_METHOD, REFERENCE_METHOD))
    return specs


def _method_spec(name: str, config_text: str, target: str, taken_labels: list[str]) -> MethodSpec:
    if name not in KNOWN_METHODS:
        raise ValueError(f"unknown benchmark method {name!r}; known: {', '.join(KNOWN_METHODS)}")
    overrides = _config_overrides(name, config_text)
    label = str(overrides.pop("label", "") or _free_label(name, taken_labels))
    if label in taken_labels:
        raise ValueError(f"two benchmark methods share the label {label!r}")
    draft_policy = overrides.pop("draft_policy", None)
    if name == REFERENCE_METHOD:
        if overrides or draft_policy is not None:
            raise ValueError(
                f"method 'none' takes no speculative config, got {overrides or {'draft_policy': draft_policy}}"
            )
        return MethodSpec(label, name)
    from specdec.config import DRAFT_POLICIES

    if draft_policy is not None and draft_policy not in DRAFT_POLICIES:
        raise ValueError(
            f"unknown draft_policy {draft_policy!r} for method {label!r}; known: {', '.join(DRAFT_POLICIES)}"
        )
    config = {"method": name, **DEFAULT_METHOD_CONFIGS[name], **overrides}
    if name == "draft_model" and "model" not in config:
        config["model"] = default_draft(target)
    from specdec.config import SpeculativeConfig

    SpeculativeConfig.from_dict(config)  # validate now, with the config's own error messages
    return MethodSpec(label, name, config, draft_policy)


def _config_overrides(name: str, config_text: str) -> dict[str, Any]:
    if not config_text:
        return {}
    try:
        overrides = json.loads(config_text)
    except json.JSONDecodeError as error:
        raise ValueError(f"malformed JSON config for method {name!r}: {error}") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"config for method {name!r} must be a JSON object, got {config_text!r}")
    if "method" in overrides and overrides["method"] != name:
        raise ValueError(f"config for method {name!r} names another method: {overrides['method']!r}")
    return overrides


def _free_label(name: str, taken_labels: list[str]) -> str:
    label, number = name, 1
    while label in taken_labels:
        number += 1
        label = f"{name}-{number}"
    return label


def default_draft(target: str) -> str:
    draft = DEFAULT_DRAFTS.get(target)
    if draft is None:
        raise ValueError(
            f"method 'draft_model' has no default draft for target {target!r} (defaults: "
            f"{', '.join(f'{t} -> {d}' for t, d in DEFAULT_DRAFTS.items())}); give one: "
            "draft_model:{\"model\": \"NAME_OR_PATH\"}"
        )
    return draft


def draft_model_of(specs: list[MethodSpec]) -> str | None:
    """The draft model of the first ``draft_model`` method, for peers' assisted generation."""
    for spec in specs:
        if spec.method == "draft_model" and spec.config:
            return spec.config["model"]
    return None


class SpecdecRunner(Runner):
    """One of our methods: an LLM (sharing the loaded target) with its drafter, batch 1, greedy."""

    family = "specdec"

    def __init__(self, spec: MethodSpec, loaded, weight_format: str, max_model_len: int,
                 device: str | None = None, draft_policy: str = "adaptive") -> None:
        from specdec.llm import LLM

        self.spec = spec
        self.label = spec.label
        self.reference = None if spec.method == REFERENCE_METHOD else REFERENCE_METHOD
        self.strict = True
        self.draft_policy = spec.draft_policy or draft_policy
        self.llm = LLM(loaded=loaded, speculative_config=spec.config, weight_format=weight_format,
                       max_model_len=max_model_len, max_num_seqs=1, device=device,
                       draft_policy=self.draft_policy)

    def generate(self, prompt_token_ids: list[int], max_new_tokens: int) -> Generation:
        import time

        from specdec.config import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        first_token_at: list[float] = []

        def on_output(step_output) -> None:
            if step_output.new_token_ids and not first_token_at:
                first_token_at.append(time.perf_counter())

        started = time.perf_counter()
        output = self.llm.generate([list(prompt_token_ids)], params, speculative=self.spec.config is not None,
                                   on_output=on_output)[0]
        wall_s = time.perf_counter() - started
        m = output.metrics
        speculative = self.spec.config is not None
        return Generation(
            token_ids=list(output.token_ids), wall_s=wall_s, finish_reason=output.finish_reason,
            first_token_s=first_token_at[0] - started if first_token_at else None,
            verify_steps=m.verify_steps if speculative else None,
            drafted_tokens=m.drafted_tokens if speculative else None,
            accepted_tokens=m.accepted_tokens if speculative else None,
            drafted_per_position=list(m.drafted_per_position) if speculative else None,
            accepted_per_position=list(m.accepted_per_position) if speculative else None,
            draft_time_s=m.draft_time_s, target_time_s=m.target_time_s, verify_time_s=m.verify_time_s,
        )

    def describe(self) -> dict[str, Any]:
        return {"label": self.label, "family": self.family, "method": self.spec.method, "config": self.spec.config,
                "draft_policy": self.draft_policy if self.spec.config else None, "reference": self.reference}
