"""Builds the drafter a SpeculativeConfig asks for, rejecting unsupported combinations up front."""
from __future__ import annotations

import warnings

from specdec.config import DEFAULT_DRAFT_WEIGHT_FORMAT, SpeculativeConfig
from specdec.drafters.base import Drafter
from specdec.models.tokenizer import Tokenizer
from specdec.models.transformer import Transformer


LOOKUP_METHODS = ("ngram", "suffix")  # drafters that read only the tokens: no model, no hidden states


def build_drafter(config: SpeculativeConfig, target: Transformer, tokenizer: Tokenizer, max_model_len: int,
                  max_num_seqs: int) -> Drafter:
    if config.method in LOOKUP_METHODS:
        return build_lookup_drafter(config)
    if config.method == "draft_model":
        return _build_draft_model(config, target, tokenizer, max_model_len, max_num_seqs)
    if config.method in ("eagle", "medusa"):
        return build_head_drafter(config.method, config.model, target, max_model_len, max_num_seqs,
                                  config.num_draft_branches, config.draft_tree_min_prob)
    raise ValueError(f"speculative method {config.method!r} is not implemented yet")


def build_lookup_drafter(config: SpeculativeConfig) -> Drafter:
    """The drafter of a lookup method (ngram, suffix); any other method is an error."""
    if config.method == "ngram":
        from specdec.drafters.ngram import NgramDrafter

        return NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min, config.num_draft_branches)
    if config.method == "suffix":
        from specdec.drafters.suffix import SuffixDrafter

        return SuffixDrafter(config.suffix_max_depth, config.suffix_min_token_prob, config.suffix_cache_requests,
                             config.num_draft_branches)
    raise ValueError(
        f"method {config.method!r} is not a lookup drafter ({', '.join(LOOKUP_METHODS)}): it needs a model"
    )


def _build_draft_model(config, target: Transformer, tokenizer: Tokenizer, max_model_len: int,
                       max_num_seqs: int) -> Drafter:
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.runtime import load_model

    draft, draft_tokenizer = load_model(config.model, config.weight_format or DEFAULT_DRAFT_WEIGHT_FORMAT,
                                        target.device)
    check_same_vocabulary(tokenizer, draft_tokenizer, target.config.vocab_size, draft.config.vocab_size)
    if draft.config.num_parameters >= target.config.num_parameters:
        warnings.warn(
            f"draft model {config.model!r} ({draft.config.num_parameters / 1e6:.0f}M parameters) is not smaller than "
            f"the target ({target.config.num_parameters / 1e6:.0f}M): speculation will likely be slower",
            stacklevel=2,
        )
    draft_token_ids = None
    if config.draft_vocab_size is not None:
        if config.draft_vocab_size > draft.config.vocab_size:
            raise ValueError(f"draft_vocab_size {config.draft_vocab_size} exceeds the draft model's vocabulary "
                             f"({draft.config.vocab_size})")
        draft_token_ids = [*range(config.draft_vocab_size), *tokenizer.eos_token_ids]
    return DraftModelDrafter(draft, max_num_seqs, max_model_len, config.num_draft_branches,
                             config.draft_tree_min_prob, config.draft_prefix_cache_tokens, draft_token_ids)


def check_same_vocabulary(
    target_tokenizer: Tokenizer, draft_tokenizer: Tokenizer, target_vocab: int, draft_vocab: int
) -> None:
    """The verifier compares token ids, so both models must map ids to the same tokens."""
    if target_vocab != draft_vocab:
        raise ValueError(
            f"draft model vocabulary has {draft_vocab} entries, the target's {target_vocab}: they must be the same"
        )
    size = min(target_tokenizer.vocab_size, draft_tokenizer.vocab_size)
    differing = [i for i in range(size) if target_tokenizer.id_to_token(i) != draft_tokenizer.id_to_token(i)]
    if differing or target_tokenizer.vocab_size != draft_tokenizer.vocab_size:
        examples = ", ".join(
            f"{i}: target {target_tokenizer.id_to_token(i)!r} vs draft {draft_tokenizer.id_to_token(i)!r}"
            for i in differing[:5]
        )
        raise ValueError(
            f"draft and target tokenizers differ ({len(differing)} ids differ, tokenizer sizes "
            f"{draft_tokenizer.vocab_size} vs {target_tokenizer.vocab_size}); first: {examples}"
        )


def build_head_drafter(method: str, path: str, target: Transformer, max_model_len: int, max_num_seqs: int,
                       num_branches: int = 1, min_branch_prob: float = 0.05) -> Drafter:
    """An EAGLE or Medusa drafter from a head file, checked against the target it was trained on; num_branches > 1:
    EAGLE token trees (EagleDrafter)."""
    from specdec.drafters.heads import EagleDrafter, MedusaDrafter
    from specdec.heads.config import load_head
    from specdec.heads.modules import TargetParts, build_head

    head_file = load_head(path)
    if head_file.config.method != method:
        raise ValueError(f"{path} is a {head_file.config.method!r} head, but the speculative method is {method!r}")
    head_file.config.check_target(target, path)
    head = build_head(head_file.config)
    head.load_state_dict(head_file.state)
    head.to(target.device)
    parts = TargetParts.from_target(target, head_file.draft_token_ids)
    # The head's frozen drafting copies: q8 beside any quantized target (a head's layers are small; q4 would
    # quantize them again), fp32 beside fp32.
    head_format = "fp32" if target.weight_format == "fp32" else "q8"
    if method == "eagle":
        return EagleDrafter(head, parts, target.config.vocab_size, max_num_seqs, max_model_len, head_format,
                            num_branches, min_branch_prob)
    return MedusaDrafter(head, parts, target.config.vocab_size, head_format)
