"""Edge cases end to end on tiny models: an end-of-sequence token and a stop string inside an accepted block
(greedy and seeded sampled requests), a draft model's next draft after a partial acceptance equal to a fresh
drafter's, and duplicate request ids refused before anything is allocated."""
import copy

import pytest
import torch

from specdec.config import SamplingParams
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.engine.draft_length.policy import BatchDraftPolicy
from specdec.engine.engine import Engine
from specdec.llm import LLM
from specdec.models.transformer import Transformer
from tiny_models import tiny_config, tiny_tensors
from test_speculative import PROMPTS

K = 5
PARAMS = {"greedy": dict(), "sampled": dict(temperature=1.0, top_p=0.95, seed=11)}


class OracleDrafter(Drafter):
    """Drafts the known continuation of each prompt (so every draft is accepted) and records each step's drafts
    with the output index they start at."""

    def __init__(self, continuation_by_prompt):
        self.continuation_by_prompt = continuation_by_prompt  # prompt tuple -> plain output with ignore_eos
        self.state = {}  # request id -> (continuation, output so far)
        self.proposed = []  # (request id, first output index, draft tokens)

    def add_request(self, request_id, prompt_token_ids, params, noise):
        self.state[request_id] = (self.continuation_by_prompt[tuple(prompt_token_ids)], [])

    def propose(self, request_ids, max_draft_tokens):
        drafts = []
        for request_id, budget in zip(request_ids, max_draft_tokens):
            continuation, output = self.state[request_id]
            tokens = tuple(continuation[len(output) : len(output) + budget])
            self.proposed.append((request_id, len(output), tokens))
            drafts.append(Draft(tokens))
        return drafts

    def observe(self, request_id, token_ids):
        self.state[request_id][1].extend(token_ids)

    def remove_request(self, request_id):
        del self.state[request_id]


def perturbed_tiny_model(architecture, relative_noise):
    """The tiny model of seed 0 with noise of relative_noise x each matrix's standard deviation added to its
    weights: a draft model close to its target, whose drafts are accepted in part (two independent random models
    agree too rarely for a partial acceptance)."""
    config = tiny_config(architecture)
    generator = torch.Generator().manual_seed(3)
    tensors = {name: tensor + relative_noise * tensor.std() * torch.randn(tensor.shape, generator=generator)
               if tensor.is_floating_point() and tensor.dim() == 2 else tensor
               for name, tensor in tiny_tensors(config, 0).items()}
    return Transformer(config, tensors, weight_format="q8")


def run(model, tokenizer, prompts, params, drafter=None):
    engine = Engine(model, tokenizer, max_num_seqs=4, max_model_len=256, drafter=drafter,
                    num_speculative_tokens=K if drafter else 0,
                    draft_policy=BatchDraftPolicy(K, max_verify_tokens=64) if drafter else None)
    seqs = [engine.add_request(prompt, params) for prompt in prompts]
    while engine.has_unfinished():
        engine.step()
    return seqs


def block_containing(drafter, request_id, index):
    """The recorded draft that covers output index `index`, as (first index, tokens)."""
    return next((start, tokens) for rid, start, tokens in drafter.proposed
                if rid == request_id and start <= index < start + len(tokens))


@pytest.mark.parametrize("kind", PARAMS)
def test_an_end_of_sequence_token_inside_an_accepted_block_ends_the_output_there(make_tiny_model, tiny_tokenizer,
                                                                                 kind):
    model = make_tiny_model("qwen2")
    prompt = PROMPTS[1]
    (long,) = run(model, tiny_tokenizer, [prompt], SamplingParams(max_tokens=30, ignore_eos=True, **PARAMS[kind]))
    # an end-of-sequence token that plain decoding first emits at output index 9 or later, in the middle of a block
    eos_index = next(i for i in range(9, 30) if long.output_token_ids[i] not in long.output_token_ids[:i])
    eos_tokenizer = copy.copy(tiny_tokenizer)
    eos_tokenizer.eos_token_ids = frozenset({long.output_token_ids[eos_index]})
    params = SamplingParams(max_tokens=30, **PARAMS[kind])
    (plain,) = run(model, eos_tokenizer, [prompt], params)
    drafter = OracleDrafter({tuple(prompt): long.output_token_ids})
    (speculative,) = run(model, eos_tokenizer, [prompt], params, drafter)
    assert plain.output_token_ids == long.output_token_ids[: eos_index + 1] and plain.finish_reason == "stop"
    assert (speculative.output_token_ids, speculative.text, speculative.finish_reason) == (
        plain.output_token_ids, plain.text, plain.finish_reason)
    start, tokens = block_containing(drafter, speculative.request_id, eos_index)
    assert start + len(tokens) - 1 > eos_index  # the block went on past the end-of-sequence token


@pytest.mark.parametrize("kind", PARAMS)
def test_a_stop_string_inside_an_accepted_block_cuts_the_output_there(make_tiny_model, tiny_tokenizer, kind):
    model = make_tiny_model("qwen2")
    # a stop string that first appears in the text when output token stop_index + 1 (>= 10) is added: the text
    # the two tokens stop_index, stop_index + 1 add, where that is new
    for prompt in (PROMPTS[3], *PROMPTS[:3]):
        (long,) = run(model, tiny_tokenizer, [prompt], SamplingParams(max_tokens=30, ignore_eos=True, **PARAMS[kind]))
        texts = [tiny_tokenizer.decode(long.output_token_ids[:n]) for n in range(31)]  # text of the first n tokens
        # (a text with a partial UTF-8 character, shown as U+FFFD, may still change: not those)
        candidates = ((i, texts[i + 2][len(texts[i]):]) for i in range(9, 28)
                      if texts[i + 2].startswith(texts[i + 1]) and texts[i + 1].startswith(texts[i])
                      and "\ufffd" not in texts[i + 2][len(texts[i]) - 1 :])
        stop_index, stop = next(((i, piece) for i, piece in candidates
                                 if piece and piece not in texts[i + 1]), (None, ""))
        if stop_index is not None:
            break
    assert stop_index is not None, "no prompt's output has a two-token piece to stop at"
    params = SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,), **PARAMS[kind])
    (plain,) = run(model, tiny_tokenizer, [prompt], params)
    drafter = OracleDrafter({tuple(prompt): long.output_token_ids})
    (speculative,) = run(model, tiny_tokenizer, [prompt], params, drafter)
    assert plain.finish_reason == "stop" and stop not in plain.text
    assert len(plain.output_token_ids) == stop_index + 2
    assert (speculative.output_token_ids, speculative.text, speculative.finish_reason) == (
        plain.output_token_ids, plain.text, plain.finish_reason)
    start, tokens = block_containing(drafter, speculative.request_id, stop_index + 1)
    assert start + len(tokens) - 1 > stop_index + 1  # the block went on past the stop string


class FreshDraftCheck(Drafter):
    """Wraps a DraftModelDrafter; before each of its drafts, drafts the same request with a fresh drafter (a new
    draft cache fed the committed tokens at once) and checks that both drafts are equal, draft probabilities
    bitwise. Counts the drafts that followed a partial acceptance (some drafts of the previous step rejected)."""

    def __init__(self, draft_model):
        self.draft_model = draft_model
        self.drafter = DraftModelDrafter(draft_model, max_num_seqs=4, max_model_len=256, num_branches=1)
        self.requests = {}  # request id -> (prompt, params, noise, output so far, last draft length)
        self.after_partial_acceptance = 0

    def add_request(self, request_id, prompt_token_ids, params, noise):
        self.drafter.add_request(request_id, prompt_token_ids, params, noise)
        self.requests[request_id] = [list(prompt_token_ids), params, noise, [], 0]

    def propose(self, request_ids, max_draft_tokens):
        drafts = self.drafter.propose(request_ids, max_draft_tokens)
        for request_id, budget, draft in zip(request_ids, max_draft_tokens, drafts):
            prompt, params, noise, output, _ = self.requests[request_id]
            fresh = DraftModelDrafter(self.draft_model, max_num_seqs=1, max_model_len=256, prefix_cache_tokens=0)
            fresh.add_request(request_id, prompt, params, noise)
            fresh.observe(request_id, output)
            (expected,) = fresh.propose([request_id], [budget])
            assert draft.token_ids == expected.token_ids
            assert (draft.draft_probs is None) == (expected.draft_probs is None)
            assert draft.draft_probs is None or torch.equal(draft.draft_probs, expected.draft_probs)
            self.requests[request_id][4] = len(draft.token_ids)
        return drafts

    def observe(self, request_id, token_ids):
        self.drafter.observe(request_id, token_ids)
        request = self.requests[request_id]
        if 1 < len(token_ids) <= request[4]:  # some drafts accepted, not all: the next draft follows a rollback
            self.after_partial_acceptance += 1
        request[3].extend(token_ids)

    def remove_request(self, request_id):
        self.drafter.remove_request(request_id)
        del self.requests[request_id]


@pytest.mark.parametrize("kind,acceptance", [("greedy", "exact"), ("sampled", "exact"), ("sampled", "rejection")])
def test_a_draft_after_a_partial_acceptance_equals_a_fresh_drafters(make_tiny_model, tiny_tokenizer, kind, acceptance):
    model = make_tiny_model("qwen2")
    check = FreshDraftCheck(perturbed_tiny_model("qwen2", relative_noise=0.05))
    engine = Engine(model, tiny_tokenizer, max_num_seqs=4, max_model_len=256, drafter=check, num_speculative_tokens=4,
                    draft_policy=BatchDraftPolicy(4, max_verify_tokens=64), acceptance=acceptance)
    params = {"greedy": SamplingParams(max_tokens=40),
              "sampled": SamplingParams(temperature=0.7, max_tokens=40, seed=5)}[kind]
    for prompt in PROMPTS:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert check.after_partial_acceptance > 0


def test_duplicate_request_ids_are_refused_before_anything_is_allocated(make_tiny_model, tiny_tokenizer):
    from specdec.drafters.ngram import NgramDrafter

    drafter = NgramDrafter(3, 1)
    llm = LLM(loaded=(make_tiny_model("llama"), tiny_tokenizer), drafter=drafter, draft_policy="fixed",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4}, max_num_seqs=4)
    engine = llm.engine
    free_slots = engine.cache.free_slots
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match=r"duplicate request ids \['a'\]"):
        llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], params, request_ids=["a", "b", "a"])
    with pytest.raises(ValueError, match="got 1 request ids for 2 prompts"):
        llm.generate([PROMPTS[0], PROMPTS[1]], params, request_ids=["a"])
    with pytest.raises(ValueError, match="the prompt is empty"):  # the batch's other prompts are withdrawn too
        llm.generate([PROMPTS[0], []], params, request_ids=["a", "b"])
    assert not engine.waiting and not engine.running and engine.cache.free_slots == free_slots
    assert not drafter._index_by_request  # the drafter never saw a request
    outputs = llm.generate([PROMPTS[0], PROMPTS[1]], params, request_ids=["a", "b"])
    assert [output.request_id for output in outputs] == ["a", "b"] and all(output.token_ids for output in outputs)
    # the engine's own API: an id in use by an unfinished request is refused, and automatic ids skip ids in use
    engine.add_request(PROMPTS[0], params, request_id="x")
    with pytest.raises(ValueError, match="request id 'x' is already in use by an unfinished request"):
        engine.add_request(PROMPTS[1], params, request_id="x")
    engine.add_request(PROMPTS[1], params, request_id=str(engine._next_id))
    automatic = engine.add_request(PROMPTS[2], params)
    assert len(engine.waiting) == 3 and len({seq.request_id for seq in engine.waiting}) == 3
    assert automatic.request_id not in ("x",)
