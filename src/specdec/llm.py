"""Public Python API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from specdec.cache.kv_cache import kv_cache_dtype as kv_dtype
from specdec.config import DEFAULT_ACCEPTANCE, GuidedDecoding, SamplingParams, SpeculativeConfig
from specdec.drafters.base import Drafter
from specdec.drafters.factory import build_drafter
from specdec.engine.draft_length.adaptive import build_draft_policy
from specdec.engine.draft_length.policy import DraftLengthPolicy
from specdec.engine.engine import Engine, StepOutput
from specdec.engine.metrics import SpecDecodeMetrics
from specdec.engine.sequence import Sequence as EngineSequence
from specdec.engine.sequence import TokenKind
from specdec.engine.tensor_parallel import TensorParallelGroup
from specdec.models.catalog import DEFAULT_MODEL
from specdec.models.tokenizer import Tokenizer
from specdec.models.transformer import Transformer
from specdec.runtime import default_device, load_target


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    token_kinds: tuple[TokenKind, ...]
    text: str
    finish_reason: str
    metrics: SpecDecodeMetrics
    elapsed_s: float  # wall time from the first step to this request's end
    # wall time from the first step to this request's first new token (its prompt's prefill and the first token;
    # elapsed_s when it produced none)
    first_token_s: float = 0.0
    # constrained requests (verify/grammar.py; 0 otherwise): time computing the grammar's allowed-token masks and how
    # many (one per verify row and per draft end check), and all of the grammar engine's time after the grammar
    # compiled (masks, emitted tokens consumed, drafts validated, forced tokens)
    grammar_mask_time_s: float = 0.0
    grammar_masks: int = 0
    grammar_time_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time, the prompt's prefill included."""
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """The decode phase alone: the tokens after the first per second after the first (what llama.cpp's "eval"
        and the bench's decode_tokens_per_s measure); 0 with fewer than two tokens."""
        decode_s = self.elapsed_s - self.first_token_s
        return (len(self.token_ids) - 1) / decode_s if len(self.token_ids) > 1 and decode_s > 0 else 0.0


class LLM:
    """A target model, optionally with a drafter, and an engine that batches requests."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        speculative_config: SpeculativeConfig | dict | str | None = None,
        weight_format: str = "auto",
        max_model_len: int = 4096,
        max_num_seqs: int = 8,
        device: str | None = None,
        loaded: tuple[Transformer, Tokenizer] | None = None,
        drafter: Drafter | None = None,
        max_verify_tokens: int = 32,
        prefill_chunk: int = 512,
        draft_policy: str | DraftLengthPolicy = "adaptive",
        kv_cache_dtype: str = "auto",
        prefix_cache_tokens: int = 0,
        tensor_parallel_size: int = 1,
    ) -> None:
        """loaded: an already built (model, tokenizer) to share between LLMs; drafter: a ready drafter to use
        instead of building the one speculative_config names (its num_speculative_tokens still applies).
        draft_policy: "adaptive" (k per request and step from acceptance and the measured cost profile, at most
        num_speculative_tokens), "fixed" (BatchDraftPolicy) or a DraftLengthPolicy instance.
        kv_cache_dtype: the target's KV cache, "auto" (the model's default: fp16 beside q8 weights, fp32 beside
        fp32 weights), "float16" or "float32".
        prefix_cache_tokens: keys/values of up to this many tokens of earlier requests kept, so that a prompt
        starting with them (a shared system turn, the next turn of a conversation) copies them instead of
        prefilling them; 0 = off. Outputs are the same either way.
        tensor_parallel_size: processes the target is split over (this one is rank 0 and runs the engine; the others
        are spawned, see engine/tensor_parallel.py; `close` stops them). Greedy outputs are exact at a given size."""
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        self.spec_config = _as_spec_config(speculative_config)
        kv_dtype(kv_cache_dtype, torch.float32)  # an unknown name fails here, before any weights are loaded
        self.device = torch.device(device) if device else default_device()
        if loaded is not None and tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size splits a model LLM loads; a loaded model is split already")
        self.parallel_group: TensorParallelGroup | None = None
        if loaded is not None:
            self.model, self.tokenizer = loaded
        else:
            self.model, self.tokenizer, self.parallel_group = load_target(model, weight_format, self.device,
                                                                          tensor_parallel_size)
        self.max_model_len = min(max_model_len, self.model.config.max_position_embeddings)
        if self.spec_config is not None and drafter is None:
            drafter = build_drafter(self.spec_config, self.model, self.tokenizer, max_model_len=self.max_model_len,
                                    max_num_seqs=max_num_seqs)
        k = self.spec_config.num_speculative_tokens if self.spec_config else 0
        if drafter is not None and self.spec_config is None:
            raise ValueError("a drafter needs a speculative_config (for num_speculative_tokens)")
        policy = build_draft_policy(draft_policy, k, max_verify_tokens, self.model, drafter,
                                    model_name=self.model.source or None, weight_format=weight_format)
        self.engine = Engine(self.model, self.tokenizer, max_num_seqs, self.max_model_len, drafter, k,
                             prefill_chunk=prefill_chunk, max_verify_tokens=max_verify_tokens, draft_policy=policy,
                             kv_cache_dtype=kv_dtype(kv_cache_dtype, self.model.kv_cache_dtype),
                             prefix_cache_tokens=prefix_cache_tokens,
                             acceptance=self.spec_config.acceptance if self.spec_config else DEFAULT_ACCEPTANCE)

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any (they also stop when this process exits)."""
        if self.parallel_group is not None:
            self.parallel_group.close()

    def encode_prompt(self, prompt: str | Sequence[int] | list[dict], chat: bool = False) -> list[int]:
        if isinstance(prompt, (list, tuple)) and (not prompt or isinstance(prompt[0], int)):
            return list(prompt)  # token ids (an empty list is refused by the engine: the prompt is empty)
        if chat or isinstance(prompt, list):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            return self.tokenizer.encode_chat(messages)
        return self.tokenizer.encode(prompt)

    def generate(
        self,
        prompts: str | Sequence[str | list[int]],
        params: SamplingParams | None = None,
        chat: bool = False,
        speculative: bool = True,
        on_output: Callable[[StepOutput], None] | None = None,
        request_ids: Sequence[str] | None = None,
        **sampling: Any,
    ) -> list[RequestOutput]:
        """Generates for every prompt (batched); results in prompt order. on_output streams each step's tokens.
        request_ids: one id per prompt (they name the streamed StepOutputs), unique, and none in use by an unfinished
        request; checked before any request is queued. None: the engine numbers the requests.
        sampling: instead of params, SamplingParams' fields as keywords (max_tokens=64, temperature=0.7,
        presence_penalty=0.5, min_p=0.1, ...) and a constraint as one of json_schema (a dict or JSON text),
        json_object=True, regex or grammar (llguidance's Lark); see `sampling_params_from`."""
        params = sampling_params_from(params, sampling)
        single = isinstance(prompts, str)
        prompt_list = [prompts] if single else list(prompts)
        ids = self._checked_request_ids(request_ids, len(prompt_list))
        token_lists = [self.encode_prompt(p, chat) for p in prompt_list]
        seqs: list[EngineSequence] = []
        try:
            for tokens, request_id in zip(token_lists, ids):
                seqs.append(self.engine.add_request(tokens, params, request_id=request_id, speculative=speculative))
        except ValueError:  # a prompt the engine refuses: none of the batch runs (queued requests hold no slot yet)
            for seq in seqs:
                self.engine.abort(seq.request_id)
            raise
        start = time.perf_counter()
        ended_at: dict[str, float] = {}
        first_token_at: dict[str, float] = {}
        while self.engine.has_unfinished():
            for output in self.engine.step():
                now = time.perf_counter()
                if output.new_token_ids and output.request_id not in first_token_at:
                    first_token_at[output.request_id] = now
                if output.finished:
                    ended_at[output.request_id] = now
                if on_output is not None:
                    on_output(output)
        outputs = []
        for seq in seqs:
            ended = ended_at.get(seq.request_id, time.perf_counter())
            outputs.append(_request_output(seq, ended - start, first_token_at.get(seq.request_id, ended) - start))
        return outputs


    def _checked_request_ids(self, request_ids: Sequence[str] | None, num_prompts: int) -> list[str | None]:
        """The ids to queue the prompts under (None: numbered by the engine); duplicates, ids in use and a count
        other than the prompts' are errors."""
        if request_ids is None:
            return [None] * num_prompts
        ids = list(request_ids)
        if len(ids) != num_prompts:
            raise ValueError(f"got {len(ids)} request ids for {num_prompts} prompts")
        if not all(isinstance(request_id, str) and request_id for request_id in ids):
            raise ValueError(f"request ids must be non-empty strings, got {ids!r}")
        duplicates = sorted({request_id for request_id in ids if ids.count(request_id) > 1})
        if duplicates:
            raise ValueError(f"duplicate request ids {duplicates}: each request needs its own id")
        in_use = [request_id for request_id in ids if self.engine.has_request(request_id)]
        if in_use:
            raise ValueError(f"request ids {in_use} are already in use by unfinished requests")
        return ids


GUIDED_KEYWORDS = {"json_schema": "json_schema", "json_object": "json_object", "regex": "regex", "grammar": "lark"}


def sampling_params_from(params: SamplingParams | None, keywords: dict[str, Any]) -> SamplingParams:
    """The SamplingParams of a generate call: params, or one built from keyword arguments (SamplingParams' fields;
    stop as a string or list; json_schema, json_object, regex or grammar as the constraint). Both at once, unknown
    keywords, or a constraint keyword beside guided are errors."""
    if params is not None:
        if keywords:
            raise ValueError(f"pass a SamplingParams or keyword arguments ({', '.join(sorted(keywords))}), not both")
        return params
    fields = {field.name for field in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(keywords) - fields - set(GUIDED_KEYWORDS))
    if unknown:
        raise ValueError(f"unknown sampling keyword arguments {unknown}: SamplingParams' fields and "
                         f"{', '.join(GUIDED_KEYWORDS)} are accepted")
    options = {name: value for name, value in keywords.items() if name in fields}
    constraint = {GUIDED_KEYWORDS[name]: value for name, value in keywords.items()
                  if name in GUIDED_KEYWORDS and value not in (None, False)}
    if constraint:
        if options.get("guided") is not None:
            raise ValueError(f"give the constraint once: guided or {', '.join(GUIDED_KEYWORDS)}, not both")
        options["guided"] = GuidedDecoding(**constraint)
    stop = options.get("stop")
    if isinstance(stop, (str, list)):
        options["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    return SamplingParams(**options)


def _request_output(seq: EngineSequence, elapsed_s: float, first_token_s: float) -> RequestOutput:
    grammar = seq.grammar
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=tuple(seq.prompt_token_ids),
        token_ids=tuple(seq.output_token_ids),
        token_kinds=tuple(seq.token_kinds),
        text=seq.text,
        finish_reason=seq.finish_reason or "abort",
        metrics=seq.metrics,
        elapsed_s=elapsed_s,
        first_token_s=first_token_s,
        grammar_mask_time_s=grammar.mask_time_s if grammar is not None else 0.0,
        grammar_masks=grammar.masks_computed if grammar is not None else 0,
        grammar_time_s=grammar.grammar_time_s if grammar is not None else 0.0,
    )


def _as_spec_config(value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, dict):
        return SpeculativeConfig.from_dict(value)
    return SpeculativeConfig.from_json(value)
