"""GrammarMatcher (verify/grammar.py) on the tiny byte-level tokenizer: masks, advancing, draft prefixes, end."""
import json

import pytest
import torch

from specdec.config import GuidedDecoding, SamplingParams
from specdec.verify.grammar import GrammarMatcher, mask_logits

VOCAB = 300  # the tiny models' logits width (the tokenizer has 258 tokens)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}


def matcher(tokenizer, **guided):
    return GrammarMatcher(GuidedDecoding(**guided), tokenizer, VOCAB, tokenizer.eos_token_ids)


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def allowed_text(tokenizer, m):
    return {tokenizer.decode([t]) for t in torch.nonzero(m.allowed()).flatten().tolist()}


def test_mask_follows_the_state_and_ends_with_eos(tiny_tokenizer):
    m = matcher(tiny_tokenizer, json_schema=SCHEMA)
    assert allowed_text(tiny_tokenizer, m) == {"{"}
    for token in ids(tiny_tokenizer, '{"n":12'):
        assert m.advance(token)
    assert allowed_text(tiny_tokenizer, m) == set("0123456789}")
    assert m.advance(ids(tiny_tokenizer, "}")[0]) and m.is_finished
    (eos,) = tiny_tokenizer.eos_token_ids
    assert torch.nonzero(m.allowed()).flatten().tolist() == [eos]
    assert m.allowed().shape == (VOCAB,)
    assert m.masks_computed >= 3 and m.mask_time_s > 0


def test_advance_refuses_a_forbidden_token_and_keeps_the_state(tiny_tokenizer):
    m = matcher(tiny_tokenizer, regex="ab+c")
    assert not m.advance(ids(tiny_tokenizer, "b")[0])
    assert m.advance(ids(tiny_tokenizer, "a")[0])
    assert allowed_text(tiny_tokenizer, m) == {"b"}
    assert m.forced_tokens() == ids(tiny_tokenizer, "b")


def test_valid_prefix_and_masks_along_leave_the_state_alone(tiny_tokenizer):
    m = matcher(tiny_tokenizer, regex="(ab|cd)+e")
    (eos,) = tiny_tokenizer.eos_token_ids
    assert m.valid_prefix(ids(tiny_tokenizer, "abcdx")) == 4
    assert m.valid_prefix(ids(tiny_tokenizer, "abe") + [eos, 5]) == 4  # the end token counts and ends the draft
    assert m.valid_prefix(ids(tiny_tokenizer, "ab") + [eos]) == 2  # the grammar cannot end after "ab"
    draft = ids(tiny_tokenizer, "abcx")
    masks = m.masks_along(draft, len(draft) + 1)
    assert masks.shape == (5, VOCAB)
    assert torch.equal(masks[0], m.allowed())  # the committed state is unchanged
    assert masks[1][ids(tiny_tokenizer, "b")[0]] and not masks[1][ids(tiny_tokenizer, "a")[0]]
    assert torch.equal(masks[4], masks[3])  # after the forbidden "x": the last valid row repeated
    logits = mask_logits(torch.zeros(5, VOCAB), masks)
    assert torch.isinf(logits[0]).sum() == VOCAB - 2  # "a" or "c"


def test_json_object_masks_to_an_object(tiny_tokenizer):
    m = matcher(tiny_tokenizer, json_object=True)
    text = '{"a": [1, 2], "b": {"c": null}}'
    for token in ids(tiny_tokenizer, text):
        assert m.advance(token)
    assert json.loads(text) and m.allowed()[next(iter(tiny_tokenizer.eos_token_ids))]


@pytest.mark.parametrize("guided,match", [
    (dict(), "exactly one"),
    (dict(regex="a", json_object=True), "exactly one"),
    (dict(json_schema="{not json"), "not valid JSON"),
    (dict(json_schema="[1]"), "must be a JSON object"),
    (dict(regex=""), "non-empty"),
])
def test_guided_decoding_validation(guided, match):
    with pytest.raises(ValueError, match=match):
        GuidedDecoding(**guided)


def test_invalid_grammar_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match="invalid regex constraint"):
        matcher(tiny_tokenizer, regex="a(b")


def test_guided_with_ignore_eos_needs_a_stop_token():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(guided=GuidedDecoding(json_object=True), ignore_eos=True)
    SamplingParams(guided=GuidedDecoding(json_object=True), ignore_eos=True, stop_token_ids=(3,))


def test_warm_up_builds_the_tokenizer_view_once(tmp_path):
    from specdec.models.tokenizer import Tokenizer
    from specdec.verify.grammar import has_ll_tokenizer, ll_tokenizer, start_warm_up
    from tiny_models import write_tiny_tokenizer

    tokenizer = Tokenizer.from_hf_dir(write_tiny_tokenizer(tmp_path))  # fresh: no view cached for it yet
    assert not has_ll_tokenizer(tokenizer, VOCAB)
    start_warm_up(tokenizer, VOCAB).join(60)
    assert has_ll_tokenizer(tokenizer, VOCAB) and not has_ll_tokenizer(tokenizer, VOCAB + 1)
    view = ll_tokenizer(tokenizer, VOCAB)
    assert ll_tokenizer(tokenizer, VOCAB) is view  # the cached view, not a new build


def test_grammar_time_counts_every_call_once(tiny_tokenizer):
    m = matcher(tiny_tokenizer, regex="(ab|cd)+e")
    m.masks_along(ids(tiny_tokenizer, "abc"), 4)  # allowed() inside is not counted twice
    assert m.masks_computed == 4 and 0 < m.mask_time_s <= m.grammar_time_s
    before = m.grammar_time_s
    assert m.advance(ids(tiny_tokenizer, "a")[0])
    assert m.grammar_time_s > before and m.masks_computed == 4
