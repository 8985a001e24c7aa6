"""Per-request sampling parameters and the speculative-decoding configuration."""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "eagle", "medusa")
# what 'model' names for the methods that need one
MODEL_MEANING = {
    "draft_model": "the draft model's name or path",
    "eagle": "the head file written by `specdec train-draft`",
    "medusa": "the head file written by `specdec train-draft`",
}
METHODS_WITHOUT_DRAFT_MODEL = ("ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 32
MAX_DRAFT_BRANCHES = 8
# num_draft_branches when the config leaves it out: the drafters that grow dynamic trees with acceptance probabilities,
# cut by the cost
# model, draft trees (measured: docs/methods.md, token trees); lookups draft chains.
DEFAULT_DRAFT_BRANCHES = {"draft_model": 4, "eagle": 4}
DRAFT_WEIGHT_FORMATS = ("auto", "q4", "q4-all", "q5", "q8", "fp32")  # models/layers.py: WEIGHT_FORMATS
# a draft model's format when the config leaves it out: its weights choose which tokens are proposed, never the
# output, so it takes the format with the cheapest forward (measured: docs/kernels.md, weight formats)
DEFAULT_DRAFT_WEIGHT_FORMAT = "q4-all"
# how sampled requests verify drafts: "exact" emits plain seeded sampling's own draws (verify/exact.py);
# "rejection" is rejection sampling (verify/rejection.py). Both give the target's distribution.
ACCEPTANCE_METHODS = ("exact", "rejection")
DEFAULT_ACCEPTANCE = "exact"
DRAFT_POLICIES = ("adaptive", "fixed")  # adaptive: k per step from acceptance and measured costs; fixed: always k


def _require_int(owner: str, name: str, value: object) -> None:
    # bool is a subclass of int; True is never a meaningful count.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")


def _require_number(owner: str, name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be finite, got {value!r}")


def _require_at_least(owner: str, name: str, value: int, minimum: int) -> None:
    _require_int(owner, name, value)
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")


GUIDED_KINDS = ("json_schema", "json_object", "regex", "lark")


@dataclass(frozen=True)
class GuidedDecoding:
    """A constraint on a request's output, enforced by masking the target's logits (verify/grammar.py).

    Exactly one field is set:
    json_schema: a JSON Schema, as JSON text (a dict is accepted and serialized); the output is JSON matching it.
    json_object: True: the output is one JSON object (OpenAI's response_format {"type": "json_object"}).
    regex: the whole output matches this regular expression.
    lark: a grammar in llguidance's Lark dialect.
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    lark: str | None = None

    def __post_init__(self) -> None:
        owner = "GuidedDecoding"
        if isinstance(self.json_schema, Mapping):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if not isinstance(self.json_object, bool):
            raise ValueError(f"{owner}.json_object must be a bool, got {type(self.json_object).__name__}")
        for name in ("json_schema", "regex", "lark"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{owner}.{name} must be a non-empty string, got {value!r}")
        chosen = [name for name in GUIDED_KINDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"{owner} needs exactly one of {', '.join(GUIDED_KINDS)}, got "
                             f"{', '.join(chosen) or 'none'}")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"{owner}.json_schema is not valid JSON: {error}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"{owner}.json_schema must be a JSON object (a schema), got {type(schema).__name__}")

    @property
    def kind(self) -> str:
        return next(name for name in GUIDED_KINDS if getattr(self, name) not in (None, False))


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns target logits into tokens.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it before top-k / top-p.
    top_k: keep only the k most likely tokens; 0 turns the filter off.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1.0 turns it off.
    seed: seeds the request's torch.Generator; None draws a random seed.
    max_tokens: the most tokens to generate for the request.
    stop: strings that end the generation when they appear in the output.
    ignore_eos: keep generating past the end-of-sequence token.
    logprobs: None = no log-probabilities; n >= 0 = the chosen token's log-probability plus the n most
        likely alternatives, from the target's raw distribution (before temperature/top-k/top-p, as vLLM).

    Penalties and biases (vLLM's semantics; verify/penalties.py applies them, before temperature):
    presence_penalty: subtracted from the logit of every token the output already holds (0 = off).
    frequency_penalty: subtracted once per occurrence in the output (0 = off).
    repetition_penalty: for tokens of the prompt or the output, positive logits are divided by it and negative ones
        multiplied (HF / vLLM; 1 = off, > 1 discourages repeats).
    logit_bias: (token id, bias) pairs (a dict is accepted) added to the logits.
    min_tokens: end-of-sequence and stop_token_ids are banned until the output has this many tokens (stop strings
        are not looked for before then either).
    min_p: after temperature, tokens whose probability is below min_p times the most likely token's are dropped
        (0 = off).
    stop_token_ids: tokens that end the generation like end-of-sequence (kept in the token ids, not in the text).
    guided: a constraint on the output (JSON schema, JSON object, regex or Lark grammar; GuidedDecoding), None = none.
        Exact under speculation (verify/grammar.py); constrained requests verify chains, not token trees.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    guided: GuidedDecoding | None = None

    def __post_init__(self) -> None:
        owner = "SamplingParams"
        if self.guided is not None and not isinstance(self.guided, GuidedDecoding):
            raise ValueError(f"{owner}.guided must be a GuidedDecoding or None, got {type(self.guided).__name__}")
        if self.guided is not None and self.ignore_eos and not self.stop_token_ids:
            raise ValueError(f"{owner}.guided with ignore_eos needs stop_token_ids: nothing could end the output "
                             "once the grammar is complete")
        self._validate_penalties(owner)
        _require_number(owner, "temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"{owner}.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _require_at_least(owner, "top_k", self.top_k, 0)
        _require_number(owner, "top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{owner}.top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            _require_int(owner, "seed", self.seed)
        _require_at_least(owner, "max_tokens", self.max_tokens, 1)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"{owner}.stop must be a tuple of non-empty strings, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"{owner}.ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        if self.logprobs is not None:
            _require_at_least(owner, "logprobs", self.logprobs, 0)
            if self.logprobs > 20:
                raise ValueError(f"{owner}.logprobs must be at most 20, got {self.logprobs}")

    def _validate_penalties(self, owner: str) -> None:
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            _require_number(owner, name, getattr(self, name))
        if self.repetition_penalty <= 0:
            raise ValueError(f"{owner}.repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"{owner}.min_p must be in [0, 1], got {self.min_p}")
        _require_at_least(owner, "min_tokens", self.min_tokens, 0)
        bias = self.logit_bias
        pairs = tuple(bias.items()) if isinstance(bias, Mapping) else bias
        if not isinstance(pairs, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
            raise ValueError(f"{owner}.logit_bias must be a dict or a tuple of (token id, bias) pairs, got {bias!r}")
        for token_id, value in pairs:
            _require_at_least(owner, "logit_bias token id", token_id, 0)
            _require_number(owner, f"logit_bias[{token_id}]", value)
        object.__setattr__(self, "logit_bias", tuple(sorted((token_id, float(value)) for token_id, value in pairs)))
        stop_ids = self.stop_token_ids
        if isinstance(stop_ids, list):
            stop_ids = tuple(stop_ids)
        if not isinstance(stop_ids, tuple):
            raise ValueError(f"{owner}.stop_token_ids must be a tuple of token ids, got {self.stop_token_ids!r}")
        for token_id in stop_ids:
            _require_at_least(owner, "stop_token_ids entry", token_id, 0)
        object.__setattr__(self, "stop_token_ids", stop_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Whether penalties, biases or min_tokens change the logits (verify/penalties.py); min_p is applied with
        temperature, top-k and top-p."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)

    def token_ids_in_params(self) -> list[int]:
        """Token ids the parameters name (logit_bias, stop_token_ids), for a range check against the vocabulary."""
        return [token_id for token_id, _ in self.logit_bias] + list(self.stop_token_ids)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which drafter proposes tokens and how many; keys follow vLLM's ``speculative_config``.

    vLLM's keys:
      method: "ngram" (prompt lookup), "suffix" (suffix trie over the request and past requests),
          "draft_model" (a smaller model of the same tokenizer), "eagle" (a trained EAGLE-style head that reads
          the target's hidden states) or "medusa" (trained Medusa heads); see docs/draft-heads.md.
      num_speculative_tokens: tokens drafted per verify step, 1..32.
      model: the draft model's name or path for "draft_model"; the head file (``specdec train-draft --out``)
          for "eagle" / "medusa"; rejected for "ngram" / "suffix".
      prompt_lookup_max: longest n-gram the ngram drafter tries to match (>= 1).
      prompt_lookup_min: shortest n-gram the ngram drafter tries to match (>= 1, <= prompt_lookup_max).

    Our key (sampled requests):
      acceptance: "exact" (default) or "rejection". exact: a draft token is accepted when it equals the token
          plain seeded sampling draws at its position (one uniform number per output position, keyed by the
          request's seed), so the output is plain seeded sampling's, token for token, and a sampling drafter
          draws with the same numbers; rejection: rejection sampling with the drafter's probabilities (same
          distribution, different tokens than plain sampling). Greedy requests are verified the same way
          under both. Measured: docs/methods.md, "Sampled requests: acceptance".

    Our key (token trees):
      num_draft_branches: token trees, 1..8 (1 = chains; the default for ngram and suffix; 4 for draft_model and eagle,
          whose trees the adaptive policy cuts to what pays). The target verifies the tree in one forward;
          num_speculative_tokens bounds its depth, and the engine caps its nodes at the sequence's share of
          max_verify_tokens rows. Greedy requests verify trees of every drafter; sampled requests (temperature > 0)
          verify ngram and suffix trees under exact acceptance and chains otherwise. ngram: up to this many
          branches, the continuations of earlier occurrences; suffix: the other continuations of the matched trie
          path. draft_model and eagle grow EAGLE-2's dynamic tree of this width: at every depth the chain's node and
          the num_draft_branches - 1 likeliest other nodes are expanded, each adding its num_draft_branches
          likeliest next tokens; the chain comes first, then the other nodes by path probability (up to
          num_draft_branches * num_speculative_tokens nodes), and with the adaptive draft policy the engine keeps
          those that raise the step's expected tokens per second under the measured cost model (medusa: chains
          only).
      draft_tree_min_prob: draft_model and eagle trees: a node other than the chain's is expanded or
          verified only when the draft probability of its path (the product of its tokens' draft
          probabilities) is at least this, in [0, 1] (default 0.05).
      draft_prefix_cache_tokens: draft_model only: how many tokens of earlier requests' prompts the draft
          model's prefix store keeps (>= 0, default 4096; 0 disables it). A new request copies the draft
          cache entries of the longest shared prefix (at least 16 tokens) instead of prefilling them.
      draft_vocab_size: draft_model only: the draft model drafts over its lm_head rows of token ids
          0 .. draft_vocab_size - 1 (byte-level BPE numbers tokens in merge order, frequent ones first) and
          its end-of-sequence tokens, instead of the whole vocabulary (FR-Spec's reduced draft head): each
          draft forward reads fewer weights. Drafts stay verified by the target, so the output is unchanged;
          a sampled draft's distribution is the reduced one. None (default) = the whole vocabulary.
      weight_format: draft_model only: the draft model's weight format (auto, q4, q4-all, q5, q8 or fp32); None
          (default) = q4-all (DEFAULT_DRAFT_WEIGHT_FORMAT), whatever the target's.

    Our keys (suffix drafter only):
      suffix_max_depth: depth limit of the suffix trie = longest context + draft it can match (>= 1).
      suffix_min_token_prob: the draft stops once the running product of the empirical continuation
          probabilities falls below this, in [0, 1].
      suffix_cache_requests: how many finished requests' outputs (each with its prompt's last
          suffix_max_depth // 4 tokens) the cross-request cache keeps
          (>= 0; 0 disables the cache).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    suffix_max_depth: int = 64
    suffix_min_token_prob: float = 0.1
    suffix_cache_requests: int = 64
    num_draft_branches: int | None = None  # None: DEFAULT_DRAFT_BRANCHES for the method, else 1
    draft_tree_min_prob: float = 0.05
    draft_prefix_cache_tokens: int = 4096  # Qwen-0.5B: 24.6 KB of keys and values per token
    draft_vocab_size: int | None = None
    weight_format: str | None = None
    acceptance: str = DEFAULT_ACCEPTANCE

    def __post_init__(self) -> None:
        self._validate_method_and_model()
        owner = "SpeculativeConfig"
        if self.acceptance not in ACCEPTANCE_METHODS:
            raise ValueError(f"{owner}.acceptance must be one of {', '.join(map(repr, ACCEPTANCE_METHODS))}, "
                             f"got {self.acceptance!r}")
        if self.num_draft_branches is None:
            object.__setattr__(self, "num_draft_branches", DEFAULT_DRAFT_BRANCHES.get(self.method, 1))
        _require_at_least(owner, "num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"{owner}.num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        _require_at_least(owner, "prompt_lookup_max", self.prompt_lookup_max, 1)
        _require_at_least(owner, "prompt_lookup_min", self.prompt_lookup_min, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"{owner}.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        _require_at_least(owner, "suffix_max_depth", self.suffix_max_depth, 1)
        _require_number(owner, "suffix_min_token_prob", self.suffix_min_token_prob)
        if not 0 <= self.suffix_min_token_prob <= 1:
            raise ValueError(f"{owner}.suffix_min_token_prob must be in [0, 1], got {self.suffix_min_token_prob}")
        _require_at_least(owner, "suffix_cache_requests", self.suffix_cache_requests, 0)
        _require_at_least(owner, "num_draft_branches", self.num_draft_branches, 1)
        if self.num_draft_branches > MAX_DRAFT_BRANCHES:
            raise ValueError(
                f"{owner}.num_draft_branches must be <= {MAX_DRAFT_BRANCHES}, got {self.num_draft_branches}"
            )
        if self.num_draft_branches > 1 and self.method == "medusa":
            raise ValueError(f"{owner}.num_draft_branches > 1 (token trees) is not available for method 'medusa'; "
                             "use 1, or method 'eagle'")
        _require_number(owner, "draft_tree_min_prob", self.draft_tree_min_prob)
        if not 0 <= self.draft_tree_min_prob <= 1:
            raise ValueError(f"{owner}.draft_tree_min_prob must be in [0, 1], got {self.draft_tree_min_prob}")
        _require_at_least(owner, "draft_prefix_cache_tokens", self.draft_prefix_cache_tokens, 0)
        if self.draft_vocab_size is not None:
            if self.method != "draft_model":
                raise ValueError(f"{owner}.draft_vocab_size applies to method 'draft_model' only, not {self.method!r}")
            _require_at_least(owner, "draft_vocab_size", self.draft_vocab_size, 1)
        if self.weight_format is not None:
            if self.method != "draft_model":
                raise ValueError(f"{owner}.weight_format applies to method 'draft_model' only, not {self.method!r}")
            if self.weight_format not in DRAFT_WEIGHT_FORMATS:
                raise ValueError(f"{owner}.weight_format must be one of {', '.join(DRAFT_WEIGHT_FORMATS)}, "
                                 f"got {self.weight_format!r}")

    def _validate_method_and_model(self) -> None:
        if not isinstance(self.method, str):
            raise ValueError(f"SpeculativeConfig.method must be a string, got {type(self.method).__name__}")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; known methods: {', '.join(SPECULATIVE_METHODS)}"
            )
        if self.model is not None and not (isinstance(self.model, str) and self.model):
            raise ValueError(f"SpeculativeConfig.model must be a non-empty string or None, got {self.model!r}")
        if self.method in MODEL_MEANING and self.model is None:
            raise ValueError(f"speculative method {self.method!r} needs 'model' ({MODEL_MEANING[self.method]})")
        if self.method in METHODS_WITHOUT_DRAFT_MODEL and self.model is not None:
            raise ValueError(
                f"speculative method {self.method!r} uses no draft model, but 'model' was given: {self.model!r}"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(data, dict):
            raise ValueError(f"speculative config must be a JSON object / dict, got {type(data).__name__}")
        valid_keys = [f.name for f in dataclasses.fields(cls)]
        unknown_keys = sorted(set(data) - set(valid_keys), key=str)
        if unknown_keys:
            raise ValueError(
                f"unknown speculative config key(s): {', '.join(map(repr, unknown_keys))}; "
                f"valid keys: {', '.join(valid_keys)}"
            )
        missing_keys = [f.name for f in dataclasses.fields(cls) if _is_required(f) and f.name not in data]
        if missing_keys:
            raise ValueError(f"speculative config is missing required key(s): {', '.join(missing_keys)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"malformed speculative config JSON: {error}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _is_required(config_field: dataclasses.Field) -> bool:
    no_default = config_field.default is dataclasses.MISSING
    return no_default and config_field.default_factory is dataclasses.MISSING
