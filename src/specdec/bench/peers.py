"""Peer engines run side by side with ours: HF transformers, llama-cpp-python, vLLM.

Every peer gets the very same prompts as our methods: the token ids our tokenizer makes with the model's own
chat template (no peer-side tokenizer or template is involved), and it stops at the same end-of-sequence
ids. Each peer has a plain row (its reference) and speculative rows, checked against its own plain output.
Peers are imported lazily and never needed by the tests; a missing package is a clear error.

  transformers  hf:plain, hf:prompt_lookup (prompt_lookup_num_tokens = ngram's k, max_matching_ngram_size =
                ngram's prompt_lookup_max), hf:assisted (assistant_model = the draft model, when a draft_model
                method is benchmarked). fp32 weights (transformers dequantizes GGUF). Their acceptance rate is
                unknown; the mean accepted length is estimated from the number of target forward passes.
  llama-cpp     llama:plain, llama:prompt_lookup (LlamaPromptLookupDecoding) on the GGUF file.
  vllm          vllm:plain, vllm:ngram (vLLM's own n-gram speculation).
"""
from __future__ import annotations

import importlib.util
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.bench.methods import DEFAULT_METHOD_CONFIGS, Generation, MethodSpec, Runner


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
            raise PeerUnavailable(f"peer {self.name!r} needs the Python package {self.package!r}, "
                                  f"which is not installed (pip install {self.package})")

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
        assistant = {"assistant_model": self.generate_kwargs["assistant_model"]} if "assistant_model" in self.generate_kwargs else {}
        input_ids = torch.tensor([prompt_token_ids])
        self.forward_calls = 0
        started = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                         generation_config=config, **assistant)
        wall_s = time.perf_counter() - started
        token_ids = output[0, len(prompt_token_ids):].tolist()
        return self._generation(token_ids, wall_s, max_new_tokens)

    def _generation(self, token_ids: list[int], wall_s: float, max_new_tokens: int) -> Generation:
        finish = "stop" if token_ids and token_ids[-1] in self.eos_token_ids else "length"
        if self.reference is None or self.forward_calls < 2:
            return Generation(token_ids, wall_s, finish)
        # the first forward is the prefill (1 token); each later one verifies and emits >= 1 token
        verify_steps = self.forward_calls - 1
        accepted = max(len(token_ids) - 1 - verify_steps, 0)
        return Generation(token_ids, wall_s, finish, verify_steps=verify_steps, accepted_tokens=accepted)


# ---- llama-cpp-python ---------------------------------------------------------------------------------------

class LlamaCppPeer(Peer):
    name, module, package = "llama-cpp", "llama_cpp", "llama-cpp-python"

    def build_runners(self, context: PeerContext) -> list[Runner]:
        if context.model_path.suffix != ".gguf":
            raise PeerUnavailable(f"peer 'llama-cpp' needs a .gguf model, got {context.model_path}")
        ngram = context.method_config("ngram")
        return [
            LlamaCppRunner("llama:plain", None, context, None),
            LlamaCppRunner("llama:prompt_lookup", "llama:plain", context, ngram["num_speculative_tokens"]),
        ]


class LlamaCppRunner(_PeerRunner):
    def __init__(self, label: str, reference: str | None, context: PeerContext, num_pred_tokens: int | None) -> None:
        from llama_cpp import Llama, LlamaPromptLookupDecoding

        super().__init__("llama-cpp", label, reference,
                         {"engine": "llama-cpp-python", "num_pred_tokens": num_pred_tokens})
        draft = LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens) if num_pred_tokens else None
        self.llama = Llama(model_path=str(context.model_path), n_ctx=context.max_model_len,
                           n_threads=context.threads, draft_model=draft, verbose=False)
        self.eos_token_ids = set(context.eos_token_ids) | {self.llama.token_eos()}

    def generate(self, prompt_token_ids: list[int], max_new_tokens: int) -> Generation:
        self.llama.reset()
        token_ids: list[int] = []
        started = time.perf_counter()
        for token in self.llama.generate(prompt_token_ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                                         reset=True):
            token_ids.append(int(token))
            if token in self.eos_token_ids or len(token_ids) >= max_new_tokens:
                break
        wall_s = time.perf_counter() - started
        finish = "stop" if token_ids and token_ids[-1] in self.eos_token_ids else "length"
        return Generation(token_ids, wall_s, finish)


# ---- vLLM ---------------------------------------------------------------------------------------------------

class VllmPeer(Peer):
    name, module, package = "vllm", "vllm", "vllm (CPU build)"

    def build_runners(self, context: PeerContext) -> list[Runner]:
        ngram = context.method_config("ngram")
        spec = {"method": "ngram", "num_speculative_tokens": ngram["num_speculative_tokens"],
                "prompt_lookup_max": ngram.get("prompt_lookup_max", 4),
                "prompt_lookup_min": ngram.get("prompt_lookup_min", 2)}
        return [VllmRunner("vllm:plain", None, context, None), VllmRunner("vllm:ngram", "vllm:plain", context, spec)]


class VllmRunner(_PeerRunner):
    def __init__(self, label: str, reference: str | None, context: PeerContext,
                 speculative_config: dict[str, Any] | None) -> None:
        from vllm import LLM as VllmLLM

        super().__init__("vllm", label, reference, {"engine": "vllm", "speculative_config": speculative_config})
        kwargs = {"speculative_config": speculative_config} if speculative_config else {}
        self.llm = VllmLLM(model=str(context.model_path), max_model_len=context.max_model_len, max_num_seqs=1,
                           dtype="float32", **kwargs)
        self.eos_token_ids = list(context.eos_token_ids)

    def generate(self, prompt_token_ids: list[int], max_new_tokens: int) -> Generation:
        from vllm import SamplingParams as VllmSamplingParams

        params = VllmSamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=self.eos_token_ids)
        started = time.perf_counter()
        output = self.llm.generate([{"prompt_token_ids": prompt_token_ids}], params, use_tqdm=False)[0].outputs[0]
        wall_s = time.perf_counter() - started
        token_ids = list(output.token_ids)
        return Generation(token_ids, wall_s, "stop" if output.finish_reason == "stop" else "length")


PEERS: dict[str, type[Peer]] = {peer.name: peer for peer in (TransformersPeer, LlamaCppPeer, VllmPeer)}


def make_peer(name: str) -> Peer:
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; known peers: {', '.join(PEERS)}")
    peer = PEERS[name]()
    peer.check_available()
    return peer
