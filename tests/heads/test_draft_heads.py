"""Trained draft heads (EAGLE, Medusa) on tiny models: the target's hidden states, training lowers the loss,
saved heads reload to identical drafts, greedy output identical to plain output (batch 1 and 4), and the
sampled distribution equal to the target's (chi-square), also with a reduced draft vocabulary."""
import pytest
import torch

from specdec.cache.kv_cache import KVCache
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.drafters.base import DrafterCostDescription
from specdec.drafters.factory import build_drafter, build_head_drafter
from specdec.drafters.heads import EagleDrafter, MedusaDrafter
from specdec.models.batch import ForwardBatch
from specdec.heads.config import HeadConfig, load_head, save_head, target_fingerprint
from specdec.heads.modules import TargetParts
from specdec.models.layers import Linear
from specdec.engine.engine import Engine
from specdec.verify.noise import RequestNoise
from specdec.train.data import TrainingSequence, generate_training_sequences
from specdec.train.trainer import (Trainer, TrainSettings, chain_acceptance, draft_correctness, draft_vocabulary,
                                   pad_batch)

ARCHITECTURES = ("llama", "qwen2", "gemma3")
METHODS = ("eagle", "medusa")
PROMPTS = [
    [5, 17, 42, 5, 17, 42, 5, 17],
    [99, 3, 250, 77, 12, 8, 130, 64, 201, 99, 3, 250, 77],
    [33, 34],
    [7, 180, 91, 45, 2, 160, 222, 1, 2, 3, 4, 5, 6, 7, 180, 91, 45, 2, 160],
]
TRAIN_PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(3 + i % 9)] for i in range(24)] + PROMPTS


def head_config(model, method: str, draft_vocab_size: int | None = None) -> HeadConfig:
    c = model.config
    common = dict(
        method=method,
        target_name=c.name,
        target_fingerprint=target_fingerprint(model),
        hidden_size=c.hidden_size,
        vocab_size=c.vocab_size,
        draft_vocab_size=draft_vocab_size or c.vocab_size,
        embedding_scale=c.embedding_scale,
        final_logit_softcap=c.final_logit_softcap,
        rms_norm_eps=c.rms_norm_eps,
    )
    if method == "medusa":
        return HeadConfig(**common, num_medusa_heads=3)
    return HeadConfig(**common, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                      intermediate_size=2 * c.hidden_size, rope_theta=c.rope_theta)


def generate_continuations(target, tokenizer, prompts, max_new_tokens, max_len, batch_size) -> list[list[int]]:
    """prompt + greedy continuation per prompt (truncated to max_len tokens; the prompt to max_len - 1)."""
    from specdec.drafters.ngram import NgramDrafter

    engine = Engine(target, tokenizer, max_num_seqs=batch_size, max_model_len=max_len + 1, drafter=NgramDrafter(4, 2),
                    num_speculative_tokens=4)
    seqs = [engine.add_request(prompt[: max_len - 1], SamplingParams(max_tokens=max_new_tokens)) for prompt in prompts]
    while engine.has_unfinished():
        engine.step()
    return [(seq.prompt_token_ids + seq.output_token_ids)[:max_len] for seq in seqs]


def hidden_states(target, sequences: list[list[int]], chunk: int = 512) -> list[torch.Tensor]:
    """The reference features: one forward pass over each finished sequence -> final-normed hidden states of
    every position, per sequence [T_i, hidden] fp32."""
    cache = KVCache(target.config, len(sequences), max(len(s) for s in sequences), target.device,
                    dtype=target.kv_cache_dtype)
    rows: list[list[torch.Tensor]] = [[] for _ in sequences]
    for start in range(0, max(len(s) for s in sequences), chunk):
        live = [i for i, s in enumerate(sequences) if len(s) > start]
        batch = ForwardBatch.build([sequences[i][start : start + chunk] for i in live], [start] * len(live), live,
                                   all_logits=False, device=target.device)
        hidden = target.forward_hidden(batch, cache).hidden  # [rows, hidden]
        for i, part in zip(live, hidden.split(list(batch.row_counts))):
            rows[i].append(part)
    return [torch.cat(parts) for parts in rows]


def training_sequences(model, tokenizer, prompts=TRAIN_PROMPTS, new_tokens=40) -> list[TrainingSequence]:
    sequences = generate_continuations(model, tokenizer, prompts, new_tokens, max_len=128, batch_size=8)
    return [TrainingSequence(torch.tensor(s), h) for s, h in zip(sequences, hidden_states(model, sequences))]


def train(model, tokenizer, method, steps, draft_vocab_size=None, checkpoint=None, sequences=None, **settings):
    sequences = sequences or training_sequences(model, tokenizer)
    config = head_config(model, method, draft_vocab_size)
    parts = TargetParts.from_target(
        model, draft_vocabulary(sequences, model.config.vocab_size, config.draft_vocab_size)
    )
    lr = 3e-3 if method == "eagle" else 1e-2  # Medusa's heads start at zero (the identity) and need a push
    trainer = Trainer(config, parts, sequences, TrainSettings(steps=steps, batch_tokens=512, lr=lr, warmup_steps=5,
                                                              **settings), checkpoint=checkpoint)
    trainer.run()
    return trainer


def make_head_drafter(trainer, model, max_num_seqs=4, max_model_len=256, weight_format="q8"):
    if trainer.config.method == "eagle":
        return EagleDrafter(
            trainer.head, trainer.parts, model.config.vocab_size, max_num_seqs, max_model_len, weight_format
        )
    return MedusaDrafter(trainer.head, trainer.parts, model.config.vocab_size, weight_format)


# ---- target hidden states --------------------------------------------------------------------------------
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_forward_hidden_gives_forward_logits_bit_for_bit(make_tiny_model, architecture):
    model = make_tiny_model(architecture)
    batch = ForwardBatch.build([PROMPTS[1], PROMPTS[3]], [0, 0], [0, 1], all_logits=False)
    logits = model.forward(batch, KVCache(model.config, 2, 64))
    output = model.forward_hidden(batch, KVCache(model.config, 2, 64))
    assert torch.equal(output.logits, logits)
    assert output.hidden.shape == (len(PROMPTS[1]) + len(PROMPTS[3]), model.config.hidden_size)
    assert torch.equal(model.logits(output.hidden[batch.logits_rows]), logits)  # what lm_head reads


# ---- training ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_training_a_few_steps_lowers_the_loss(trained_heads, method):
    history = trained_heads("qwen2", method).state.history
    first, last = sum(r.loss for r in history[:5]) / 5, sum(r.loss for r in history[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert sum(r.accuracy for r in history[-5:]) > sum(r.accuracy for r in history[:5])


def test_training_resumes_from_its_checkpoint(make_tiny_model, tiny_tokenizer, tmp_path):
    model = make_tiny_model("llama")
    sequences = training_sequences(model, tiny_tokenizer, TRAIN_PROMPTS[:8], new_tokens=16)
    straight = train(model, tiny_tokenizer, "eagle", steps=6, sequences=sequences)
    checkpoint = tmp_path / "head.ckpt"
    interrupted = train(
        model, tiny_tokenizer, "eagle", steps=6, sequences=sequences, checkpoint=checkpoint, time_limit_s=0.0
    )
    assert interrupted.state.step == 1 and checkpoint.is_file()  # stopped after its first step, checkpoint written
    resumed = train(model, tiny_tokenizer, "eagle", steps=6, sequences=sequences, checkpoint=checkpoint)
    assert resumed.state.step == 6 and len(resumed.state.history) == 6
    assert [r.loss for r in resumed.state.history] == pytest.approx([r.loss for r in straight.state.history], rel=1e-4)


@torch.no_grad()
def test_unrolled_training_steps_see_what_a_chain_draft_sees(make_tiny_model):
    """Training-time test: step s of forward_unrolled at position t must equal the head's state when drafting
    depth s through its KV cache (real pairs up to t - s + 1, then its own drafted positions)."""
    from specdec.heads.modules import EagleHead

    torch.manual_seed(0)
    config = head_config(make_tiny_model("qwen2"), "eagle")
    head = EagleHead(config).eval()
    length = 12
    embeds, hidden = torch.randn(2, length, config.hidden_size), torch.randn(2, length, config.hidden_size)
    unrolled = head.forward_unrolled(embeds, hidden, steps=3)  # each [2, T, hidden]
    assert torch.equal(unrolled[0], head(embeds, hidden))  # step 1 is the teacher-forced forward
    for row in range(2):
        for start in (2, 5, 9):  # real pairs at 0 .. start - 1, then two drafted positions
            cache = KVCache(head.cache_config(), 1, 64)
            real_pairs = ForwardBatch.build([[0] * start], [0], [0], all_logits=True)
            step_one = head.forward_cached(real_pairs, embeds[row, :start], hidden[row, :start], cache)
            assert torch.allclose(step_one, unrolled[0][row, :start], atol=1e-5)
            predicted = step_one[-1:]
            for depth in (2, 3):
                position = start + depth - 2
                draft_row = ForwardBatch.build([[0]], [position], [0], all_logits=True)
                predicted = head.forward_cached(draft_row, embeds[row, position : position + 1], predicted, cache)
                assert torch.allclose(predicted[0], unrolled[depth - 1][row, position], atol=1e-5), (row, start, depth)
    other = head.forward_unrolled(embeds, hidden.roll(1, dims=1), steps=2)[1]  # the check above can fail
    assert not torch.allclose(other, unrolled[1], atol=1e-3)


def test_heads_draft_with_int8_copies_of_their_weights(trained_heads, make_tiny_model):
    """Drafting runs frozen copies of the head's linear maps in the target's weight format: q8 reads about a quarter
    of the fp32 bytes and stays close to the trained fp32 head; fp32 copies give exactly the training modules."""
    model = make_tiny_model("qwen2")
    trainer = trained_heads("qwen2", "eagle")
    q8, fp32 = make_head_drafter(trainer, model), make_head_drafter(trainer, model, weight_format="fp32")
    assert all(linear.quantized is not None for linear in q8.projections.as_list() + [q8.draft_lm_head])
    assert q8.weight_nbytes < 0.35 * fp32.weight_nbytes
    torch.manual_seed(0)
    rows, hidden_size = 6, trainer.config.hidden_size
    embeds, hidden = torch.randn(rows, hidden_size), torch.randn(rows, hidden_size)
    batch = ForwardBatch.build([[0] * rows], [0], [0], all_logits=True)  # the head reads embeds, not token ids

    def predict(projections):
        cache = KVCache(trainer.head.cache_config(), 1, 64)
        return trainer.head.forward_cached(batch, embeds, hidden, cache, projections)

    modules = predict(None)
    assert torch.equal(predict(fp32.projections), modules)
    quantized = predict(q8.projections)
    assert not torch.equal(quantized, modules)
    assert float((quantized - modules).norm() / modules.norm()) < 0.05
    logits = trainer.parts.draft_logits(modules)
    assert float((trainer.parts.draft_logits(modules, q8.draft_lm_head) - logits).norm() / logits.norm()) < 0.05


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_features_recorded_while_generating_equal_a_second_pass(make_tiny_model, tiny_tokenizer, architecture):
    """The hidden rows the engine hands over while it generates (greedy and sampled, n-gram speculation, a batch
    of mixed lengths) are bit for bit those of one forward pass over the finished sequence."""
    model = make_tiny_model(architecture)
    prompts = PROMPTS + TRAIN_PROMPTS[:4]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True) for i in range(len(prompts))]
    sequences = generate_training_sequences(model, tiny_tokenizer, prompts, 30, max_len=64, batch_size=3, params=params)
    assert [s.prompt_length for s in sequences] == [len(p) for p in prompts]
    full = [s.token_ids.tolist() for s in sequences]
    for sequence, prompt, reference in zip(sequences, prompts, hidden_states(model, full)):
        assert sequence.token_ids.tolist()[: len(prompt)] == prompt
        assert len(sequence.token_ids) > len(prompt) + 20  # most of the continuation is kept (all but its last token)
        assert torch.equal(sequence.hidden, reference.to(torch.float16))
    greedy = generate_continuations(model, tiny_tokenizer, prompts[1::2], 30, max_len=64, batch_size=3)
    assert [s.token_ids.tolist() for s in sequences[1::2]] == [
        g[: len(s.token_ids)] for g, s in zip(greedy, sequences[1::2])
    ]


def test_bf16_training_tracks_fp32_training(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("qwen2")
    sequences = training_sequences(model, tiny_tokenizer, TRAIN_PROMPTS[:12], new_tokens=24)
    fp32 = train(model, tiny_tokenizer, "eagle", steps=30, sequences=sequences, unroll_steps=2).state.history
    bf16 = train(model, tiny_tokenizer, "eagle", steps=30, sequences=sequences, unroll_steps=2,
                 precision="bf16").state.history
    assert bf16[0].loss != fp32[0].loss  # autocast did change the arithmetic
    assert bf16[0].loss == pytest.approx(fp32[0].loss, rel=0.03)
    first, last = (sum(r.loss for r in rows) / 5 for rows in (bf16[:5], bf16[-5:]))
    assert last < 0.8 * first and last == pytest.approx(sum(r.loss for r in fp32[-5:]) / 5, rel=0.15)
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16"):
        TrainSettings(precision="fp16")


def test_continuation_loss_positions_leave_out_the_prompt(make_tiny_model):
    model = make_tiny_model("qwen2")
    parts = TargetParts.from_target(model, torch.arange(model.config.vocab_size))
    batch = [TrainingSequence(torch.arange(6), torch.zeros(6, model.config.hidden_size), prompt_length=4),
             TrainingSequence(torch.arange(3), torch.zeros(3, model.config.hidden_size), prompt_length=0)]
    assert pad_batch(batch, parts, "cpu")[2].tolist() == [[True] * 6, [True] * 3 + [False] * 3]
    assert pad_batch(batch, parts, "cpu", "continuation")[2].tolist() == [[False] * 4 + [True] * 2,
                                                                           [True] * 3 + [False] * 3]
    with pytest.raises(ValueError, match="loss_positions must be one of all, continuation"):
        TrainSettings(loss_positions="prompt")
    with pytest.raises(ValueError, match="not both 0"):
        TrainSettings(feature_weight=0.0, token_weight=0.0)


def test_chain_acceptance_counts_greedy_chains_by_hand():
    """Medusa heads at their initial identity each draft token u + 1 again from h(u); with one-hot states and an
    identity output layer the accepted chains can be counted by hand."""
    from specdec.heads.modules import MedusaHeads

    vocab = 4
    tokens = torch.tensor([0, 1, 2, 2, 2, 2, 3, 3, 1])
    hidden = torch.nn.functional.one_hot(torch.cat([tokens[1:], tokens[:1]]), vocab).float()  # h(t) predicts t + 1
    parts = TargetParts(Linear.build(torch.eye(vocab), None, "fp32"), 1.0, torch.eye(vocab), torch.arange(vocab), None)
    config = HeadConfig(method="medusa", target_name="t", target_fingerprint="f", hidden_size=vocab, vocab_size=vocab,
                        draft_vocab_size=vocab, num_medusa_heads=3)
    result = chain_acceptance(MedusaHeads(config), parts, [TrainingSequence(tokens, hidden, prompt_length=2)], depth=3)
    # starts u = 1..6 draft token u + 1 (2, 2, 2, 2, 3, 3) at depths 1..3 against tokens u + 2 .. u + 4:
    # accepted chain lengths 3, 2, 1, 0, 1, 0; depth 3 is right only from u = 1
    assert result.starts == 6
    assert result.chain_acceptance == pytest.approx((4 / 6, 2 / 6, 1 / 6))
    assert result.depth_accuracy == pytest.approx((4 / 6, 2 / 6, 1 / 6))
    assert result.mean_accepted_length == pytest.approx(1 + 7 / 6)


def test_chain_acceptance_predicts_what_greedy_speculation_accepts(make_tiny_model, tiny_tokenizer, trained_heads):
    """Every verify step of greedy speculation with the EAGLE head (fixed k) accepts what draft_correctness says
    the chain from that position gets accepted: the evaluation runs no target, yet sees what the engine sees."""
    from engine.test_speculative import run
    from specdec.engine.sequence import TokenKind

    model, trainer, k = make_tiny_model("qwen2"), trained_heads("qwen2", "eagle"), 3
    drafter = make_head_drafter(trainer, model, weight_format="fp32")  # the training modules' own arithmetic
    seqs, _ = run(model, tiny_tokenizer, PROMPTS, SamplingParams(max_tokens=40), drafter, k=k)
    full = [seq.prompt_token_ids + seq.output_token_ids for seq in seqs]
    batch = [TrainingSequence(torch.tensor(s), h, len(seq.prompt_token_ids))
             for s, h, seq in zip(full, hidden_states(model, full), seqs)]
    correct, valid_start = draft_correctness(trainer.head, trainer.parts, batch, k)  # [k, B, T], [B, T]
    checked = accepted_any = 0
    for row, seq in enumerate(seqs):
        committed, accepted = len(seq.prompt_token_ids) + 1, 0  # the prefill's token
        for kind in seq.token_kinds[1:]:
            if kind == TokenKind.ACCEPTED:
                accepted += 1
                continue
            start = committed - 2  # the chain drafted from the pair (h(n - 2), token n - 1) with n committed
            if kind == TokenKind.RECOVERED:  # rejected at depth accepted + 1
                assert valid_start[row, start]
                assert correct[:accepted, row, start].all() and not correct[accepted, row, start], (row, start)
                checked += 1
            elif kind == TokenKind.BONUS:
                assert correct[:accepted, row, start].all(), (row, start)
            accepted_any += accepted
            committed, accepted = committed + accepted + 1, 0
    assert checked > 5 and accepted_any > 5  # the comparison saw rejections and acceptances


def test_draft_vocabulary_takes_the_most_frequent_tokens():
    sequences = [TrainingSequence(torch.tensor([5, 5, 5, 9, 9, 2, 7]), torch.zeros(7, 4))]
    assert draft_vocabulary(sequences, vocab_size=10, size=3).tolist() == [2, 5, 9]  # 2 beats 7 on the lower id


# ---- head files --------------------------------------------------------------------------------------------
def prefilled_drafts(drafter, model, params, prompts=PROMPTS, k=5):
    """Prefills the target on each prompt, feeds the drafter like the engine does, returns its drafts."""
    cache = KVCache(model.config, len(prompts), 64)
    batch = ForwardBatch.build(prompts, [0] * len(prompts), list(range(len(prompts))), all_logits=False)
    output = model.forward_hidden(batch, cache)
    for i, (prompt, hidden) in enumerate(zip(prompts, output.hidden.split(list(batch.row_counts)))):
        noise = None if params.greedy else RequestNoise(seed=i)
        drafter.add_request(str(i), prompt, params, noise)
        drafter.observe_target_hidden(str(i), hidden)
        drafter.observe(str(i), [int(output.logits[i].argmax())])
    return drafter.propose([str(i) for i in range(len(prompts))], [k] * len(prompts))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_saved_head_reloads_to_identical_drafts(trained_heads, make_tiny_model, tmp_path, method, temperature):
    model, trainer = make_tiny_model("qwen2"), trained_heads("qwen2", method)
    path = save_head(tmp_path / f"{method}.safetensors", trainer.config, trainer.head.state_dict(),
                     trainer.parts.draft_token_ids, {"steps": trainer.state.step})
    assert load_head(path).training == {"steps": trainer.state.step}
    params = SamplingParams(temperature=temperature)
    before = prefilled_drafts(make_head_drafter(trainer, model), model, params)
    after = prefilled_drafts(build_head_drafter(method, str(path), model, 256, 4), model, params)
    assert [d.token_ids for d in after] == [d.token_ids for d in before]
    assert all(len(d.token_ids) == (5 if method == "eagle" else 3) for d in after)  # Medusa: one per head
    if temperature:
        assert all(torch.equal(a.draft_probs, b.draft_probs) for a, b in zip(after, before))


def test_head_for_another_target_is_refused_with_the_reason(trained_heads, make_tiny_model, tmp_path):
    trainer = trained_heads("qwen2", "eagle")
    path = save_head(
        tmp_path / "h.safetensors", trainer.config, trainer.head.state_dict(), trainer.parts.draft_token_ids, {}
    )
    with pytest.raises(
        ValueError, match=r"trained on tiny-qwen2 \(fingerprint [0-9a-f]{16}\); the target's weights differ"
    ):
        build_head_drafter("eagle", str(path), make_tiny_model("qwen2", seed=5), 256, 4)
    with pytest.raises(ValueError, match="trained for hidden size 64 and vocabulary 300 .* the target has 64 and 8"):
        build_head_drafter("eagle", str(path), make_tiny_model("qwen2", vocab_size=8), 256, 4)
    with pytest.raises(ValueError, match="is a 'eagle' head, but the speculative method is 'medusa'"):
        build_head_drafter("medusa", str(path), make_tiny_model("qwen2"), 256, 4)
    with pytest.raises(FileNotFoundError, match="train one with `specdec train-draft`"):
        build_head_drafter("eagle", str(tmp_path / "missing.safetensors"), make_tiny_model("qwen2"), 256, 4)


@pytest.mark.parametrize("method", METHODS)
def test_speculative_config_builds_the_head_drafter(trained_heads, make_tiny_model, tiny_tokenizer, tmp_path, method):
    trainer = trained_heads("qwen2", method)
    path = save_head(
        tmp_path / "h.safetensors", trainer.config, trainer.head.state_dict(), trainer.parts.draft_token_ids, {}
    )
    config = SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 3, "model": str(path)})
    drafter = build_drafter(config, make_tiny_model("qwen2"), tiny_tokenizer, 256, 4)
    assert isinstance(drafter, EagleDrafter if method == "eagle" else MedusaDrafter)
    with pytest.raises(ValueError, match=f"speculative method '{method}' needs 'model' \\(the head file"):
        SpeculativeConfig(method=method, num_speculative_tokens=3)


def test_head_config_rejects_inconsistent_shapes():
    with pytest.raises(ValueError, match="draft_vocab_size must be in 1..300, got 301"):
        HeadConfig(method="medusa", target_name="t", target_fingerprint="f", hidden_size=64, vocab_size=300,
                   draft_vocab_size=301, num_medusa_heads=2)
    with pytest.raises(ValueError, match="unknown draft-head method 'hydra'"):
        HeadConfig(
            method="hydra", target_name="t", target_fingerprint="f", hidden_size=64, vocab_size=300, draft_vocab_size=3
        )


def test_adaptive_policy_charges_the_head_by_its_weight_bytes(trained_heads, make_tiny_model):
    from specdec.engine.draft_length.adaptive import _cached_cost_model

    model = make_tiny_model("qwen2")
    eagle_drafter = make_head_drafter(trained_heads("qwen2", "eagle"), model)
    medusa_drafter = make_head_drafter(trained_heads("qwen2", "medusa"), model)
    assert eagle_drafter.cost_description() == DrafterCostDescription(eagle_drafter.weight_nbytes, True)
    assert medusa_drafter.cost_description() == DrafterCostDescription(medusa_drafter.weight_nbytes, False)
    eagle = _cached_cost_model(model, eagle_drafter, None, "q8", 32).drafter
    medusa = _cached_cost_model(model, medusa_drafter, None, "q8", 32).drafter
    assert eagle.per_token_s > 0 and eagle.batched  # one head forward per draft position
    assert medusa.per_token_s == 0 and medusa.per_step_s > 0  # all heads in one forward


@pytest.mark.parametrize("weight_format", ["q8", "fp32"])
def test_heads_draft_with_the_targets_own_output_rows(trained_heads, make_tiny_model, weight_format):
    """The draft lm_head is the target's output layer restricted to the draft vocabulary, bit for bit (no
    dequantise-requantise round trip): with q8 the head's logits for a hidden state are exactly the target's
    logits of those token ids (each output of our kernel is computed alone); with fp32, F.linear's blocking
    depends on the width, so they agree to rounding."""
    model = make_tiny_model("qwen2", weight_format=weight_format)
    trainer = trained_heads("qwen2", "eagle")
    parts = TargetParts.from_target(model, trainer.parts.draft_token_ids)
    ids = parts.draft_token_ids
    lm_head = parts.draft_lm_head_in(weight_format)
    normed = torch.randn(5, model.config.hidden_size)
    if weight_format == "q8":
        assert torch.equal(lm_head.quantized.qweight, model.lm_head.rows(ids).quantized.qweight)
        assert torch.equal(lm_head.quantized.scale, model.lm_head.quantized.scale[ids])
        assert torch.equal(parts.draft_logits(normed, lm_head), model.logits(normed)[:, ids])
    else:
        assert torch.equal(lm_head.dense, model.lm_head.dense[ids])
        torch.testing.assert_close(parts.draft_logits(normed, lm_head), model.logits(normed)[:, ids])
