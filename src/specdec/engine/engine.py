"""The step loop: admit requests into KV-cache slots, prefill them, then decode or draft-and-verify.

One `step()` runs one target forward over the ragged batch of all running sequences: each sequence
contributes its last token plus its draft tokens (none when it does not speculate); the verifier turns
the logits into accepted drafts plus one recovered or bonus token; rejected positions are rolled back by
simply not advancing the sequence's cache length (the cache is indexed by position).

Sampled sequences draw every token with a counter-based random number keyed by (seed, output index)
(verify/noise.py). Under exact acceptance (the default) the verifier emits the target's own draw at every
position (verify/exact.py), so a seeded request's output is plain seeded sampling's whatever the batch, the
draft length or the drafter; under rejection acceptance it runs rejection sampling (verify/rejection.py).

A sequence may verify a token tree instead of a chain (Draft.tree; greedy sequences, and sampled ones under
exact acceptance): its nodes are written at scratch cache positions after the last token, the verifier walks
the tree along the target's argmax or seeded draws, and the accepted path is compacted into consecutive cache
positions. The draft length k bounds each branch's depth; the tree's node count is capped by the sequence's
share of max_verify_tokens rows (max_verify_tokens // batch size - 1, at least k). Sequences under rejection
acceptance verify the first branch as a chain.

A constrained request (SamplingParams.guided) verifies chains: its draft is cut at the first token its grammar
forbids (the tokens the grammar forces next fill the rest) and every verify row is masked with the grammar state the
drafts before it reach (verify/grammar.py).
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import torch

from specdec.cache.kv_cache import KVCache
from specdec.cache.prefix_store import PrefixCache
from specdec.config import ACCEPTANCE_METHODS, DEFAULT_ACCEPTANCE, SamplingParams
from specdec.drafters.base import Draft, Drafter, HiddenStateDrafter, verifies_trees
from specdec.drafters.tree import DraftTree
from specdec.models.batch import ForwardBatch
from specdec.engine.draft_length.policy import BatchDraftPolicy, DraftLengthPolicy, StepCost
from specdec.engine.metrics import SpecDecodeMetrics
from specdec.engine.sequence import Sequence, TokenKind, new_sequence
from specdec.engine.tensor_parallel import mirrored_caches
from specdec.models.tokenizer import Tokenizer
from specdec.models.transformer import Transformer
from specdec.verify.exact import verify_exact, verify_exact_tree
from specdec.verify.grammar import GrammarMatcher, mask_logits
from specdec.verify.noise import NoiseStream, RequestNoise, random_seed
from specdec.verify.penalties import chain_paths, process_logits, tree_paths
from specdec.verify.rejection import RejectionUniforms, VerifyResult, verify_greedy, verify_rejection
from specdec.verify.tree import TreeVerifyResult, verify_greedy_tree
from specdec.verify.sampling import greedy_tokens, logits_to_probs, sample_token

EMPTY_DRAFT = Draft(token_ids=(), draft_probs=None)


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of an emitted token under the target's raw distribution, with the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class StepOutput:
    """What one step added to one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_token_kinds: tuple[TokenKind, ...]
    new_text: str
    finish_reason: str | None
    new_logprobs: tuple[TokenLogprob, ...] | None = None  # when the request asked for logprobs
    cached_prompt_tokens: int | None = None  # on a request's first output: prompt tokens taken from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class _Proposal:
    """A step's drafts, one per decoding sequence (empty when it does not draft), and the tokens the drafter
    caught up on to draft them (`Drafter.catch_up_tokens`, summed over the drafting sequences)."""

    drafts: list[Draft]
    catch_up_tokens: int


class Engine:
    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        max_num_seqs: int = 8,
        max_model_len: int = 4096,
        drafter: Drafter | None = None,
        num_speculative_tokens: int = 0,
        prefill_chunk: int = 512,
        idle_prefill_chunk: int = 2048,
        max_verify_tokens: int = 32,
        draft_policy: DraftLengthPolicy | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        prefix_cache_tokens: int = 0,
        acceptance: str = DEFAULT_ACCEPTANCE,
    ) -> None:
        """kv_cache_dtype: torch.float32 or torch.float16; None = the model's default (`Transformer.kv_cache_dtype`).
        prefix_cache_tokens: tokens of earlier requests' keys/values kept for reuse by prompts that start with them
        (0: no prefix cache). prefill_chunk: prompt tokens per step while other sequences decode (it bounds their
        stall); idle_prefill_chunk: per step while none does (one forward for most prompts: each forward streams the
        weights once more, a 700-token Gemma-3-270M prompt took 409 ms in two chunks, 397 ms in one).
        acceptance: how sampled requests verify drafts, "exact" or "rejection" (SpeculativeConfig.acceptance)."""
        if acceptance not in ACCEPTANCE_METHODS:
            raise ValueError(f"acceptance must be one of {', '.join(map(repr, ACCEPTANCE_METHODS))}, "
                             f"got {acceptance!r}")
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        if drafter is not None and num_speculative_tokens < 1:
            raise ValueError("a drafter needs num_speculative_tokens >= 1")
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        dtype = kv_cache_dtype or model.kv_cache_dtype
        if model.parallel is None:
            self.cache = KVCache(model.config, max_num_seqs, max_model_len, model.device, dtype=dtype)
            self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        else:  # the leader of a tensor-parallel group: its heads, every operation mirrored on the other ranks
            self.cache, self.prefix_cache = mirrored_caches(model, max_num_seqs, max_model_len, dtype,
                                                            prefix_cache_tokens)
        self.drafter = drafter
        self._hidden_drafter = drafter if isinstance(drafter, HiddenStateDrafter) else None
        self.draft_policy = draft_policy or BatchDraftPolicy(num_speculative_tokens, max_verify_tokens)
        self.max_verify_tokens = max_verify_tokens
        self.acceptance = acceptance
        self.prefill_chunk = prefill_chunk
        self.idle_prefill_chunk = max(idle_prefill_chunk, prefill_chunk)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.metrics = SpecDecodeMetrics()  # engine-wide; step times counted once per step
        self._next_id = 0

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    speculative: bool = True) -> Sequence:
        """Queues a request. request_id: unique among the unfinished requests (an id in use is refused before
        anything is created); None takes the next free number. A sampled request without a seed gets a random one."""
        if request_id is None:
            while self.has_request(str(self._next_id)):
                self._next_id += 1
            request_id, self._next_id = str(self._next_id), self._next_id + 1
        elif self.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request; "
                             "request ids must be unique")
        noise = None if params.greedy else RequestNoise(random_seed() if params.seed is None else params.seed,
                                                         self.acceptance)
        seq = new_sequence(request_id, prompt_token_ids, params, self.tokenizer, self.max_model_len, noise,
                           speculative=speculative and self.drafter is not None)
        if params.guided is not None:
            end_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.tokenizer.eos_token_ids))
            seq.grammar = GrammarMatcher(params.guided, self.tokenizer, self.model.config.vocab_size, end_ids)
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish_reason = "abort"
                return True
        for seq in self.running:
            if seq.request_id == request_id:
                seq.finish_reason = "abort"
                self._release(seq)
                return True
        return False

    def has_request(self, request_id: str) -> bool:
        """Whether an unfinished (waiting or running) request has this id."""
        return any(seq.request_id == request_id for seq in (*self.waiting, *self.running))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- stepping -------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Decodes every running sequence once, then advances prompts by at most `prefill_chunk` tokens
        (`idle_prefill_chunk` when no sequence is decoding: then there is no stream to stall).

        Prefill is chunked across steps (unfinished prompts first, then new admissions into free slots), so
        a long or a burst of new prompts never stalls the running streams for more than one chunk.
        """
        decoding = [seq for seq in self.running if seq.output_token_ids and not seq.finished]
        outputs = self._decode_step(decoding) if decoding else []
        outputs += self._prefill_step(self.prefill_chunk if decoding else self.idle_prefill_chunk)
        for seq in [seq for seq in self.running if seq.finished]:
            self._release(seq)
        return outputs

    def _prefill_step(self, budget: int) -> list[StepOutput]:
        chunks: list[tuple[Sequence, list[int]]] = []
        prefilling = [seq for seq in self.running if seq.prefilling]
        while budget > 0 and (prefilling or (self.waiting and self.cache.free_slots)):
            seq = prefilling.pop(0) if prefilling else self._admit(self.waiting.popleft())
            chunk = seq.prompt_token_ids[seq.num_cached : seq.num_cached + budget]
            chunks.append((seq, chunk))
            budget -= len(chunk)
        if not chunks:
            return []
        ends_prompt = [seq.num_cached + len(chunk) == len(seq.prompt_token_ids) for seq, chunk in chunks]
        batch = ForwardBatch.build([chunk for _, chunk in chunks], [seq.num_cached for seq, _ in chunks],
                                   [seq.slot for seq, _ in chunks], all_logits=False, device=self.model.device,
                                   last_logits=ends_prompt)
        last_logits, hidden_per_seq = self._forward(batch)  # [prompts ended, vocab]
        outputs = []
        for row, (seq, chunk) in enumerate(chunks):
            seq.num_cached += len(chunk)
            if hidden_per_seq is not None and seq.speculative:
                self._hidden_drafter.observe_target_hidden(seq.request_id, hidden_per_seq[row])
            if ends_prompt[row]:
                if self.prefix_cache is not None:  # shared with later prompts while this request runs
                    self.prefix_cache.keep(self.cache, seq.slot, seq.prompt_token_ids)
                logits_row = len(outputs)
                outputs.append(self._first_token(seq, last_logits[logits_row : logits_row + 1]))
        return outputs

    def _admit(self, seq: Sequence) -> Sequence:
        seq.slot = self.cache.allocate()
        self.running.append(seq)  # from here on abort() finds it and frees the slot
        # A drafter that reads the target's hidden states needs them for every prompt position: such requests
        # prefill all of their prompt.
        if self.prefix_cache is not None and not (seq.speculative and self._hidden_drafter is not None):
            seq.num_cached = seq.cached_prompt_tokens = self.prefix_cache.reuse(self.cache, seq.slot,
                                                                                 seq.prompt_token_ids)
        if seq.speculative:
            start = time.perf_counter()
            self.drafter.add_request(seq.request_id, seq.prompt_token_ids, seq.params, seq.noise)
            if seq.grammar is not None:
                self.drafter.constrain(seq.request_id, seq.grammar.allowed_after)
            seq.metrics.draft_time_s += time.perf_counter() - start
        return seq

    def _first_token(self, seq: Sequence, logits: torch.Tensor) -> StepOutput:
        """logits [1, vocab] after the whole prompt."""
        token_id = self._sample_one(seq, logits)
        new_text = seq.append(token_id, TokenKind.TARGET)
        if seq.speculative:
            self.drafter.observe(seq.request_id, [token_id])
        return StepOutput(seq.request_id, (token_id,), (TokenKind.TARGET,), new_text, seq.finish_reason,
                          token_logprobs(logits, [token_id], seq.params.logprobs), seq.cached_prompt_tokens)

    def _sample_one(self, seq: Sequence, logits: torch.Tensor) -> int:
        """logits [1, vocab] -> one token, exactly as plain decoding samples it (with u of the next output index)."""
        logits = _processed_logits(seq, logits, [()])
        if seq.grammar is not None:
            logits = mask_logits(logits, seq.grammar.masks_along((), 1))
        if seq.params.greedy:
            return int(greedy_tokens(logits)[0])
        return sample_token(logits, seq.params, seq.noise.target(len(seq.output_token_ids)))

    def _decode_step(self, seqs: list[Sequence]) -> list[StepOutput]:
        start = time.perf_counter()
        proposal = self._propose(seqs)
        drafts = [_within_grammar(seq, draft) for seq, draft in zip(seqs, proposal.drafts)]
        trees = [_verified_tree(seq, draft) for seq, draft in zip(seqs, drafts)]
        drafted = time.perf_counter()
        batch = ForwardBatch.build(
            [[seq.last_token_id, *(tree or draft).token_ids] for seq, draft, tree in zip(seqs, drafts, trees)],
            [seq.num_cached for seq in seqs],
            [seq.slot for seq in seqs],
            all_logits=True,
            device=self.model.device,
            parents=[None if tree is None else [-1, *(parent + 1 for parent in tree.parents)] for tree in trees],
        )
        logits, hidden_per_seq = self._forward(batch)
        logits_per_seq = batch.split_logits(logits)  # each [rows_i, vocab]
        verified_at = time.perf_counter()
        results = [self._verify(seq, draft, tree, logits)
                   for seq, draft, tree, logits in zip(seqs, drafts, trees, logits_per_seq)]
        done = time.perf_counter()
        estimated = [(sum(tree.acceptance_probs), result.accepted_count) for tree, result in zip(trees, results)
                     if tree is not None and tree.acceptance_probs is not None]
        if estimated:
            self.draft_policy.observe_tree_acceptance(sum(p for p, _ in estimated), sum(a for _, a in estimated))
        step_times = (drafted - start, verified_at - drafted, done - verified_at)
        self._record_times(self.metrics, step_times)
        self.draft_policy.observe_step(StepCost(len(batch.token_ids), tuple(len(d.token_ids) for d in drafts),
                                                step_times[0], step_times[1], tuple(seq.num_cached for seq in seqs),
                                                proposal.catch_up_tokens))
        outputs = [self._commit(seq, result, step_times, _emitted_rows(result, logits))
                   for seq, result, logits in zip(seqs, results, logits_per_seq)]
        if hidden_per_seq is not None:
            for seq, output, result, hidden in zip(seqs, outputs, results, hidden_per_seq):
                if seq.speculative and not seq.finished:  # rows of the last token + the accepted drafts
                    emitted_hidden = _emitted_rows(result, hidden)[: len(output.new_token_ids)]
                    self._hidden_drafter.observe_target_hidden(seq.request_id, emitted_hidden)
        return outputs

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Target logits [logit rows, vocab], plus each sequence's hidden rows [rows_i, hidden] when the
        drafter reads hidden states (None otherwise: plain forward, nothing extra computed)."""
        if self._hidden_drafter is None:
            return self.model.forward(batch, self.cache), None
        output = self.model.forward_hidden(batch, self.cache)
        return output.logits, list(output.hidden.split(list(batch.row_counts)))

    def _propose(self, seqs: list[Sequence]) -> _Proposal:
        speculating = [seq for seq in seqs if seq.speculative]
        drafts = {}
        planned_batch = self._planning_batch_size(len(seqs))
        catch_up = [self.drafter.catch_up_tokens(seq.request_id) for seq in speculating]
        lengths = self.draft_policy.draft_lengths(speculating, planned_batch, catch_up) if speculating else []
        if any(lengths):
            budgets = [seq.max_draft_tokens(k) for seq, k in zip(speculating, lengths)]
            proposed = self.drafter.propose([seq.request_id for seq in speculating], budgets)
            node_budget = max(max(lengths), self.max_verify_tokens // len(seqs) - 1)
            capped = [draft.capped(seq.max_draft_tokens(node_budget)) for seq, draft in zip(speculating, proposed)]
            drafts = dict(
                zip(
                    (seq.request_id for seq in speculating),
                    self._cut_trees_to_what_pays(speculating, capped, planned_batch),
                )
            )
        return _Proposal([drafts.get(seq.request_id, EMPTY_DRAFT) for seq in seqs],
                         sum(tokens for tokens, k in zip(catch_up, lengths) if k))

    def _cut_trees_to_what_pays(self, seqs: list[Sequence], drafts: list[Draft], batch_size: int) -> list[Draft]:
        """Cuts the trees whose nodes carry acceptance probabilities (DraftTree.acceptance_probs) to the extra nodes
        the draft policy finds pay for their rows; the first branch always stays."""
        trees = [_verified_tree(seq, d) for seq, d in zip(seqs, drafts)]
        estimated = [tree is not None and tree.acceptance_probs is not None for tree in trees]
        if not any(estimated):
            return drafts
        verified = [
            len(d.token_ids) if e else len((tree or d).token_ids) for d, tree, e in zip(drafts, trees, estimated)
        ]
        extra_probs = [tree.acceptance_probs[len(d.token_ids):] if e else ()
                       for d, tree, e in zip(drafts, trees, estimated)]
        kept = self.draft_policy.tree_nodes(seqs, [len(d.token_ids) for d in drafts], verified, extra_probs, batch_size)
        return [d.capped(len(d.token_ids) + n) if e else d for d, e, n in zip(drafts, estimated, kept)]

    def _planning_batch_size(self, decoding: int) -> int:
        """The batch size the draft policy plans for: the decoding sequences plus those about to join them
        (prompts being prefilled, and waiting requests up to the free slots).

        While prompts are queued, a decode token gained now only saves a share of a later, fuller step (prefill
        sets the pace, one chunk per step), and the rows that speculation adds to each such step cost what they
        cost at any time; so drafts must pay at the batch the engine is about to run, not at the momentary one
        (docs/benchmarks.md, "Server under load").
        """
        joining = sum(1 for seq in self.running if seq.prefilling) + min(len(self.waiting), self.cache.free_slots)
        return decoding + joining

    def _verify(self, seq: Sequence, draft: Draft, tree: DraftTree | None,
                target_logits: torch.Tensor) -> VerifyResult | TreeVerifyResult:
        """target_logits [k+1, vocab] for a chain, [nodes+1, vocab] for a tree. The first draft position is output
        index len(seq.output_token_ids): the random numbers of a sampled request are taken from there on. Penalties
        and biases process each row with the tokens before it (verify/penalties.py), as plain decoding would."""
        start = len(seq.output_token_ids)
        paths = tree_paths(tree.token_ids, tree.parents) if tree is not None else chain_paths(draft.token_ids)
        target_logits = _processed_logits(seq, target_logits, paths)
        if seq.grammar is not None:  # row i masked with the state after draft tokens 0 .. i-1
            target_logits = mask_logits(target_logits, seq.grammar.masks_along(draft.token_ids, len(paths)))
        if tree is not None:
            if seq.params.greedy:
                return verify_greedy_tree(tree, target_logits)
            return verify_exact_tree(tree, target_logits, seq.params,
                                     seq.noise.uniforms(NoiseStream.TARGET, start, tree.depth + 1))
        if seq.params.greedy:
            return verify_greedy(draft.token_ids, target_logits)
        num_drafted = len(draft.token_ids)
        if seq.noise.exact:
            return verify_exact(draft.token_ids, target_logits, seq.params,
                                seq.noise.uniforms(NoiseStream.TARGET, start, num_drafted + 1))
        target_probs = logits_to_probs(target_logits, seq.params)  # [k+1, vocab]
        uniforms = _rejection_uniforms(seq.noise, start, num_drafted)
        return verify_rejection(draft.token_ids, draft.draft_probs, target_probs, uniforms)

    def _commit(self, seq: Sequence, result: VerifyResult | TreeVerifyResult, step_times,
                target_logits: torch.Tensor) -> StepOutput:
        """Appends the verified tokens (stopping early at EOS/stop/length exactly like plain decoding).

        target_logits [>= len(result.token_ids), vocab]: row i is the distribution token i was chosen from.
        """
        num_drafted = result.num_drafted
        kinds = [TokenKind.ACCEPTED] * result.accepted_count
        if num_drafted == 0:
            kinds.append(TokenKind.TARGET)
        else:
            kinds.append(TokenKind.BONUS if result.bonus else TokenKind.RECOVERED)
        new_ids, new_kinds, new_text = [], [], ""
        for token_id, kind in zip(result.token_ids, kinds):
            new_text += seq.append(token_id, kind)
            new_ids.append(token_id)
            new_kinds.append(kind)
            if seq.finished:
                break
        if isinstance(result, TreeVerifyResult):
            self._compact_path(seq, result.accepted_nodes)
        seq.num_cached += len(new_ids)  # the last token and the accepted drafts now have valid cache entries
        if seq.speculative:
            if num_drafted:
                seq.metrics.record_step(num_drafted, result.accepted_count)
                self.metrics.record_step(num_drafted, result.accepted_count)
            self._record_times(seq.metrics, step_times)
            if not seq.finished:
                self.drafter.observe(seq.request_id, new_ids)
        return StepOutput(seq.request_id, tuple(new_ids), tuple(new_kinds), new_text, seq.finish_reason,
                          token_logprobs(target_logits, new_ids, seq.params.logprobs))

    def _compact_path(self, seq: Sequence, accepted_nodes: tuple[int, ...]) -> None:
        """Moves the accepted tree path from its scratch cache positions to consecutive positions."""
        start = seq.num_cached + 1  # node i was written at start + i; depth d belongs at start + d
        moves = [(start + node, start + depth) for depth, node in enumerate(accepted_nodes) if node != depth]
        if moves:
            self.cache.compact(seq.slot, [src for src, _ in moves], [dst for _, dst in moves])

    @staticmethod
    def _record_times(metrics: SpecDecodeMetrics, step_times: tuple[float, float, float]) -> None:
        draft_s, target_s, verify_s = step_times
        metrics.draft_time_s += draft_s
        metrics.target_time_s += target_s
        metrics.verify_time_s += verify_s

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            if self.prefix_cache is not None:  # the committed tokens (a next turn of the conversation starts so)
                self.prefix_cache.keep(self.cache, seq.slot, seq.all_token_ids[: seq.num_cached])
            self.running.remove(seq)
            self.cache.free(seq.slot)
            seq.slot = -1
            if seq.speculative:
                self.drafter.remove_request(seq.request_id)


def _verified_tree(seq: Sequence, draft: Draft) -> DraftTree | None:
    """The tree to verify for a sequence: greedy sequences and sampled ones under exact acceptance
    (drafters.base.verifies_trees), else None (the first branch is verified as a chain)."""
    if seq.grammar is not None:  # constrained requests verify chains
        return None
    return draft.tree if draft.tree is not None and verifies_trees(seq.params, seq.noise) else None


def _within_grammar(seq: Sequence, draft: Draft) -> Draft:
    """A constrained request's draft as a chain cut at its first token the grammar forbids (verify/grammar.py),
    the cut part filled with the tokens the grammar forces after the valid prefix (point-mass drafts, free to draft
    and accepted whenever the target's tokenization agrees).

    Under rejection acceptance a draft with sampled draft probabilities keeps the forbidden token as its last instead:
    the masked target gives it probability 0, so it is rejected and the recovered token is drawn from the residual,
    as rejection sampling needs for the output to follow the masked target."""
    if seq.grammar is None or not draft.token_ids:
        return draft
    proposed = len(draft.token_ids)
    keep = seq.grammar.valid_prefix(draft.token_ids)
    if keep < proposed and draft.draft_probs is not None and seq.noise is not None and not seq.noise.exact:
        return Draft(token_ids=draft.token_ids[: keep + 1], draft_probs=draft.draft_probs[: keep + 1])
    if keep == proposed and draft.tree is None:
        return draft
    valid = draft.token_ids[:keep]
    ends = any(token_id in seq.grammar.end_token_ids for token_id in valid)
    forced = () if ends else tuple(seq.grammar.forced_after(valid, proposed - keep))
    probs = draft.draft_probs
    if probs is not None:  # the forced tokens' rows: point masses
        probs = torch.cat([probs[:keep], torch.nn.functional.one_hot(
            torch.tensor(forced, dtype=torch.long, device=probs.device), probs.shape[1]).to(probs.dtype)])
    return Draft(token_ids=valid + forced, draft_probs=probs)


def _processed_logits(seq: Sequence, logits: torch.Tensor, row_paths: list[tuple[int, ...]]) -> torch.Tensor:
    """logits [rows, vocab] with the request's penalties, biases and min_tokens; row i after row_paths[i]'s drafts."""
    return process_logits(logits, seq.params, seq.prompt_token_ids, seq.output_token_ids, row_paths,
                          seq.eos_token_ids)


def _rejection_uniforms(noise: RequestNoise, start: int, num_drafted: int) -> RejectionUniforms:
    """Rejection sampling's numbers for draft positions at output indices start .. start + k - 1: acceptance
    tests and recovered draws from their own streams, the bonus from the target's (plain decoding's u_t)."""
    return RejectionUniforms(
        accept=torch.tensor(noise.uniforms(NoiseStream.ACCEPT, start, num_drafted), dtype=torch.float64),  # [k]
        recover=torch.tensor(noise.uniforms(NoiseStream.RESIDUAL, start, num_drafted), dtype=torch.float64),  # [k]
        bonus=noise.target(start + num_drafted),
    )


def _emitted_rows(result: VerifyResult | TreeVerifyResult, per_row: torch.Tensor) -> torch.Tensor:
    """per_row [rows, ...] (target logits or hidden states of the verify block) -> the rows the emitted tokens
    were chosen from, in order (for a tree: the last token's row, then the accepted path's nodes)."""
    if isinstance(result, TreeVerifyResult):
        return per_row[result.logits_rows()]
    return per_row


def token_logprobs(
    target_logits: torch.Tensor, token_ids: list[int], num_top: int | None
) -> tuple[TokenLogprob, ...] | None:
    """target_logits [>= len(token_ids), vocab]: row i is the distribution token_ids[i] was drawn from."""
    if num_top is None:
        return None
    logprobs = torch.log_softmax(target_logits[: len(token_ids)].float(), dim=-1)  # [n, vocab]
    chosen = logprobs[torch.arange(len(token_ids)), torch.tensor(token_ids)].tolist()
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], logprobs[:, :0].long())
    return tuple(
        TokenLogprob(token_id, value, tuple(zip(ids, values)))
        for token_id, value, ids, values in zip(token_ids, chosen, top_ids.tolist(), top_values.tolist())
    )
