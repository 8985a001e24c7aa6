"""Exact draft depth and tree width studies for the lookup drafters, replayed on a bench run's plain outputs.

With greedy decoding, what a verify step commits depends only on the draft and on the target's greedy
continuation: the longest draft path that equals the continuation, plus the target's next token. A bench
run records that continuation: the plain (``none``) row's tokens of every prompt. The lookup drafters
(``ngram``, ``suffix``) need nothing from the model either, so the steps a lookup drafter would take at a
fixed draft depth k, as a chain or as a tree of a given width, are computed here exactly, without the
model, in seconds: verify steps, mean accepted length τ (1 + accepted / verify steps, as the engine reports it;
steps without a draft are plain decode steps, not verify steps), new tokens per target forward, and the draft
nodes the target would verify per step (its rows).

The engine's adaptive policy changes k from step to step and cuts trees to what pays; this replays the
fixed depth, the setting in which chains and trees are compared shape for shape (docs/draft-length.md).
Exactness: ``--draft-policy fixed`` bench rows of the same config give the same steps
(tests/bench/test_tree_replay.py) — except that the replay's suffix drafter starts with an empty
cross-request cache, while the bench's has seen its warm-up request.

    python -m specdec.bench.tree_replay bench-out/gemma-summ/results.json \\
        --config '{"method": "suffix", "num_speculative_tokens": 16}' --branches 1,2,4,8
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specdec.bench.methods import REFERENCE_METHOD
from specdec.datasets import Question, load_questions
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.factory import build_lookup_drafter
from specdec.drafters.tree import DraftTree


@dataclass(frozen=True)
class ReplayCase:
    """One recorded plain generation: the prompt the bench encoded and the target's greedy tokens."""

    category: str
    question_id: str
    turn: int
    prompt_token_ids: list[int]
    target_token_ids: list[int]  # the plain row's new tokens: the target's greedy continuation
    max_new_tokens: int  # the run's limit: drafts stay within it (an answer that ended at EOS was shorter)


@dataclass(frozen=True)
class ReplayResult:
    """One drafter config replayed over the counted cases."""

    label: str  # the drafter: its method, or the copy oracle with its context
    depth: int  # num_speculative_tokens: every step drafts up to this deep
    branches: int  # num_draft_branches (1 = chains)
    forwards: int  # target forwards after the prefill: verify steps and steps without a draft (plain decode)
    verify_steps: int  # steps with at least one draft token
    accepted_tokens: int
    draft_nodes: int  # draft tokens the target verifies, summed over the verify steps (a tree's nodes)
    new_tokens: int  # tokens after the prefill's first one

    @property
    def mean_accepted_length(self) -> float:
        """τ as the engine reports it: 1 + accepted / verify steps (tokens per verify step, bonus included)."""
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per target forward, the steps without a draft included."""
        return self.new_tokens / self.forwards if self.forwards else 0.0

    @property
    def nodes_per_step(self) -> float:
        """Draft nodes per verify step: the rows a verify adds to the one row of plain decoding."""
        return self.draft_nodes / self.verify_steps if self.verify_steps else 0.0


def accepted_draft_tokens(draft: Draft, target_token_ids: list[int]) -> int:
    """How many draft tokens greedy verification accepts, given the target's greedy tokens from here on (the
    answer's rest: a walk that reaches its end stops there)."""
    tree = draft.tree or DraftTree.from_branches([draft.token_ids])
    return len(
        tree.accepted_path(lambda node, depth: target_token_ids[depth] if depth < len(target_token_ids) else None)
    )


def replay(config: SpeculativeConfig, cases: list[ReplayCase], categories: set[str] | None = None,
           max_verify_tokens: int = 32, drafter: Drafter | None = None, label: str | None = None) -> ReplayResult:
    """Every case through one drafter (in order, as the bench feeds one runner), drafting config's depth each
    step; the steps of the cases of `categories` are counted (None: all). Every case still feeds the suffix
    drafter's cross-request cache, as in the bench. Drafts are budgeted and trees cut as the engine does for a
    batch of one with the fixed draft policy (LLM's max_verify_tokens). drafter: another drafter than config's
    (the copy oracle), given its depth and tree settings by config."""
    drafter = drafter or build_lookup_drafter(config)
    depth = config.num_speculative_tokens
    forwards = verify_steps = accepted = nodes = new_tokens = 0
    for index, case in enumerate(cases):
        request_id = f"replay-{index}"
        drafter.add_request(request_id, case.prompt_token_ids, SamplingParams(), None)
        target = case.target_token_ids
        counted = categories is None or case.category in categories
        drafter.observe(request_id, target[:1])  # the prefill's token: no draft, no verify step
        position = 1
        while position < len(target):
            # the engine's budgets (Engine._propose, Sequence.max_draft_tokens): within max_new_tokens, not
            # within the answer's end, and the tree's nodes within the rows of one verify as well
            room = case.max_new_tokens - position - 1
            draft = drafter.propose([request_id], [max(0, min(depth, room))])[0]
            draft = draft.capped(max(0, min(max(depth, max_verify_tokens - 1), room)))
            step_accepted = accepted_draft_tokens(draft, target[position:])
            step_tokens = target[position : position + step_accepted + 1]
            drafter.observe(request_id, step_tokens)
            position += len(step_tokens)
            if counted:
                forwards += 1
                new_tokens += len(step_tokens)
                if draft.token_ids:
                    verify_steps += 1
                    accepted += step_accepted
                    nodes += draft.tree.num_nodes if draft.tree is not None else len(draft.token_ids)
        drafter.remove_request(request_id)
    return ReplayResult(label or config.method, depth, config.num_draft_branches, forwards, verify_steps, accepted,
                        nodes, new_tokens)


class CopyOracle(Drafter):
    """A drafter that knows the answers: at each step, the longest next stretch of the request's recorded answer
    that occurs in its prompt + output so far right after an occurrence of its last `context` tokens.

    Its drafts never fail, so its tokens per target forward bound those of every drafter that copies from the
    request's own tokens after matching at least `context` of them (ngram: prompt_lookup_min; suffix: 1).
    Requests must be added in the order of `cases` (as `replay` does).
    """

    def __init__(self, cases: list[ReplayCase], context: int) -> None:
        if context < 1:
            raise ValueError(f"the copy oracle needs a context of at least 1 token, got {context}")
        self.context = context
        self._pending = list(cases)
        self._tokens: dict[str, list[int]] = {}
        self._case: dict[str, ReplayCase] = {}

    def add_request(self, request_id, prompt_token_ids, params, generator) -> None:
        case = self._pending.pop(0)
        if list(prompt_token_ids) != case.prompt_token_ids:
            raise ValueError("the copy oracle's requests must come in the order of its cases")
        self._case[request_id] = case
        self._tokens[request_id] = list(prompt_token_ids)

    def propose(self, request_ids, max_draft_tokens) -> list[Draft]:
        return [self._propose_one(request_id, budget) for request_id, budget in zip(request_ids, max_draft_tokens)]

    def _propose_one(self, request_id: str, budget: int) -> Draft:
        tokens, case = self._tokens[request_id], self._case[request_id]
        written = len(tokens) - len(case.prompt_token_ids)
        wanted = case.target_token_ids[written : written + budget]
        context = tokens[len(tokens) - self.context :]
        best = 0
        for start in range(len(tokens) - self.context):
            if tokens[start : start + self.context] != context:
                continue
            follow = start + self.context
            length = 0
            while length < len(wanted) and follow + length < len(tokens) and tokens[follow + length] == wanted[length]:
                length += 1
            best = max(best, length)
        return Draft(token_ids=tuple(wanted[:best]))

    def observe(self, request_id: str, token_ids) -> None:
        self._tokens[request_id].extend(int(token_id) for token_id in token_ids)

    def remove_request(self, request_id: str) -> None:
        del self._tokens[request_id], self._case[request_id]


def cases_from_results(results: dict[str, Any], tokenizer, round_index: int = 0) -> list[ReplayCase]:
    """The plain row's generations of one round, in the bench's order, with the prompts rebuilt from the
    datasets named in the run's metadata (a later turn's conversation holds the plain row's earlier answers).
    A rebuilt prompt whose length differs from the recorded one is an error (other data or tokenizer)."""
    questions = {
        (q.dataset, q.question_id): q for path in results["metadata"]["datasets"] for q in load_questions(path)
    }
    plain = [r for r in results["records"] if r["method"] == REFERENCE_METHOD and r["round"] == round_index]
    if not plain:
        raise ValueError(f"the results hold no {REFERENCE_METHOD!r} rows of round {round_index}: nothing to replay")
    answers: dict[tuple[str, str], list[dict[str, str]]] = {}
    cases = []
    for record in plain:
        key = (record["dataset"], record["question_id"])
        question: Question | None = questions.get(key)
        if question is None:
            raise ValueError(
                f"question {key[1]!r} of {key[0]} is not in the datasets {results['metadata']['datasets']}"
            )
        messages = answers.get(key, []) + [{"role": "user", "content": question.turns[record["turn"]]}]
        answers[key] = messages + [{"role": "assistant", "content": record["text"]}]
        prompt_ids = tokenizer.encode_chat(messages)
        if len(prompt_ids) != record["prompt_tokens"]:
            raise ValueError(f"question {key[1]!r} turn {record['turn']}: the rebuilt prompt has {len(prompt_ids)} "
                             f"tokens, the run recorded {record['prompt_tokens']} (another dataset or tokenizer?)")
        cases.append(ReplayCase(record["category"], record["question_id"], record["turn"], prompt_ids,
                                list(record["token_ids"]), results["metadata"]["max_new_tokens"]))
    return cases


def _table(results: list[ReplayResult]) -> str:
    chains = {(r.label, r.depth): r for r in results if r.branches == 1}
    lines = ["| drafter | depth k | branches | verify steps | τ | τ / chain τ | tokens per forward | "
             "draft nodes per verify step |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        chain = chains.get((r.label, r.depth))
        ratio = f"{r.mean_accepted_length / chain.mean_accepted_length:.3f}" if chain and chain.verify_steps else "–"
        lines.append(f"| {r.label} | {r.depth} | {r.branches} | {r.verify_steps} | {r.mean_accepted_length:.3f} | "
                     f"{ratio} | {r.tokens_per_forward:.3f} | {r.nodes_per_step:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.bench.tree_replay", description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, help="results.json of a `specdec bench` run with a 'none' row")
    parser.add_argument("--config", action="append", required=True,
                        help="a speculative config (JSON) of method ngram or suffix; repeatable")
    parser.add_argument("--branches", default="1,2,4,8", help="tree widths to replay each config at (1 = chain)")
    parser.add_argument("--categories", help="comma-separated categories to count (all prompts still feed the "
                                             "suffix cache in order)")
    parser.add_argument("--oracle-context", help="also replay the copy oracle (CopyOracle) with these contexts, "
                                                 "comma-separated, at each config's depth")
    parser.add_argument("--model", help="model name or path for the tokenizer (default: the run's model)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    try:
        results = json.loads(args.results.read_text())
        configs = [SpeculativeConfig.from_json(text) for text in args.config]
        widths = [int(width) for width in args.branches.split(",")]
        oracle_contexts = [int(context) for context in args.oracle_context.split(",")] if args.oracle_context else []
        if any(context < 1 for context in oracle_contexts):
            raise ValueError(f"--oracle-context needs contexts of at least 1 token, got {args.oracle_context}")
        configs = [replace(config, num_draft_branches=width) for config in configs for width in widths]
        for config in configs:
            build_lookup_drafter(config)  # rejects other methods before any work
        from specdec.models.loader import load_tokenizer
        from specdec.models.catalog import resolve_model

        tokenizer = load_tokenizer(resolve_model(args.model or results["metadata"]["model"]))
        categories = set(args.categories.split(",")) if args.categories else None
        all_cases = cases_from_results(results, tokenizer)
        if categories is not None and not any(case.category in categories for case in all_cases):
            raise ValueError(f"no plain row of categories {sorted(categories)} in {args.results}")
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows = [replay(config, all_cases, categories) for config in configs]
    for depth in sorted({config.num_speculative_tokens for config in configs}):
        for context in oracle_contexts:
            config = SpeculativeConfig(method="ngram", num_speculative_tokens=depth)
            rows.append(replay(config, all_cases, categories, drafter=CopyOracle(all_cases, context),
                               label=f"copy oracle, context {context}"))
    print(_table(rows))
    if args.json:
        args.json.write_text(json.dumps([{**vars(r), "mean_accepted_length": r.mean_accepted_length,
                                          "tokens_per_forward": r.tokens_per_forward,
                                          "nodes_per_step": r.nodes_per_step} for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
