"""Masking strategies: Gumbel-top-k exactness, ADM weights, scorers, schedules, whole words, resume."""

import copy
import io
import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate.utils import DistributedType
from reference import naive_entropy_scores
from transformers import BertConfig
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

from mlmlab.choices import ADAPT_SCHEDULES
from mlmlab.config import Config, MaskingConfig, ModelConfig
from mlmlab.errors import UserError
from mlmlab.experiments.budget import scorer_flops
from mlmlab.masking import scorers, seeding
from mlmlab.masking.buckets import frequency_buckets
from mlmlab.masking.schedules import adapt_factor, adapt_shape, mask_rate, rate_at
from mlmlab.masking.select import (
    Corruption,
    TokenInfo,
    continuation_table,
    count_to_select,
    eligible_positions,
    group_quotas,
    gumbel_top_k,
    mask_batch,
    select_and_corrupt,
    token_info_for,
)
from mlmlab.masking.strategies import blend, build_strategy, normalise
from mlmlab.model.pretraining import build_model, pretraining_loss
from mlmlab.train.launch import check_fsdp

V = 300  # small vocabulary: ids 0-4 special, the rest ordinary
INFO = TokenInfo(mask_id=4, special_ids=(0, 1, 2, 3, 4), ordinary_ids=torch.arange(5, V))
COUNTS = np.arange(V, 0, -1)  # id i is the i-th most frequent; freq_buckets "50,150": ids < 50, < 150, the rest
TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, dropout=0.0, pad_vocab_multiple=64)


def make_batch(batch_size=8, length=24, seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch_size, length), generator=g)  # (B, T)
    ids[:, 0], ids[:, length // 2] = 2, 3  # [CLS] ... [SEP] ...
    ids[:, -1] = 3
    ids[0, length - 6 :] = 0  # padding in row 0
    return {
        "input_ids": ids,
        "attention_mask": (ids != 0).long(),
        "token_type_ids": torch.zeros_like(ids),
        "example_ids": torch.arange(batch_size) + 100 * seed,
        "next_sentence_label": torch.zeros(batch_size, dtype=torch.long),
    }


def tiny_model(vocab=V, cfg=TINY):
    torch.manual_seed(0)  # test only: the library never touches the global RNG
    return build_model(cfg, vocab, 0).eval()


def adaptive(**overrides):
    return MaskingConfig(**{"strategy": "adaptive", **overrides})


# ----- selection ---------------------------------------------------------------------------------


def exact_inclusion(weights, k):
    """P(i in sample) for sequential weighted sampling without replacement, by enumerating orders."""
    n, total = len(weights), np.zeros(len(weights))
    for order in itertools.permutations(range(n), k):
        p, left = 1.0, sum(weights)
        for i in order:
            p *= weights[i] / left
            left -= weights[i]
        for i in order:
            total[i] += p
    return total


@pytest.mark.parametrize("weights,k", [([1.0, 2.0, 3.0, 0.5, 4.0], 2), ([0.1, 1.0, 1.0, 5.0, 0.3, 2.0], 3)])
def test_gumbel_top_k_inclusion_matches_exact_probabilities(weights, k):
    rows = 40_000
    w = torch.tensor(weights).expand(rows, -1)  # (R, n)
    eligible = torch.ones_like(w, dtype=torch.bool)
    u = seeding.uniforms(
        7, [seeding.STREAM_SELECT], torch.arange(rows), torch.zeros(rows, dtype=torch.long), len(weights)
    )[0]
    selected = gumbel_top_k(w, eligible, torch.full((rows,), k), u)
    assert (selected.sum(1) == k).all()
    empirical = selected.float().mean(0).numpy()
    exact = exact_inclusion(weights, k)
    sigma = np.sqrt(exact * (1 - exact) / rows)
    assert np.all(np.abs(empirical - exact) < 4.5 * sigma + 1e-9), (empirical, exact)


def test_streams_drawn_together_equal_streams_drawn_alone():
    g = torch.Generator().manual_seed(3)
    examples, epochs = torch.randint(0, 2**31, (9,), generator=g), torch.randint(0, 40, (9,), generator=g)
    for seed in (0, 7, 2**31 - 1):
        fused = seeding.uniforms(seed, seeding.MASK_STREAMS, examples, epochs, 37)  # (3, B, T)
        for i, stream in enumerate(seeding.MASK_STREAMS):
            assert torch.equal(fused[i], seeding.uniforms(seed, [stream], examples, epochs, 37)[0])


def test_special_tokens_never_selected_even_with_the_highest_score():
    batch = make_batch(16, 32)
    ids = batch["input_ids"]
    special = torch.isin(ids, torch.tensor(INFO.special_ids))
    weights = torch.where(special, 1e9, 1e-3)  # specials carry all the weight
    masked = mask_batch(batch, seed=1, epoch_key=0, rate=0.9, info=INFO, corruption=Corruption(), weights=weights)
    selected = masked["labels"] != -100
    assert not (selected & special).any()
    assert torch.equal(selected.sum(1), count_to_select(~special, 0.9))
    # and through ADM: a loss table that says specials are the hardest tokens
    strategy = build_strategy(adaptive(scorer="loss_ema", adapt_schedule="constant"), info=INFO, vocab_size=V)
    fake = {"labels": torch.tensor([[2, 3, 0]]), "input_ids": torch.tensor([[4, 4, 4]])}
    strategy.observe(fake, {"selected_index": torch.arange(3), "token_losses": torch.full((3,), 1e6)})
    strategy.learn()
    w = strategy.weights(None, batch, 1.0)
    masked = mask_batch(batch, seed=1, epoch_key=0, rate=0.5, info=INFO, corruption=Corruption(), weights=w)
    assert not ((masked["labels"] != -100) & special).any()


def test_a_zero_gives_exactly_the_dynamic_masks():
    batch, model = make_batch(), tiny_model()
    dynamic = build_strategy(MaskingConfig(strategy="dynamic"))
    reference = mask_batch(
        batch,
        seed=5,
        epoch_key=dynamic.epoch_key(3),
        rate=0.15,
        info=INFO,
        corruption=Corruption(),
        weights=dynamic.weights(model, batch, 0.0),
    )
    for cfg, progress in [(adaptive(), 0.0), (adaptive(a_max=0.0, adapt_schedule="constant"), 0.7)]:
        strategy = build_strategy(cfg, info=INFO, vocab_size=V)
        w = strategy.weights(model, batch, progress)
        got = mask_batch(
            batch, seed=5, epoch_key=strategy.epoch_key(3), rate=0.15, info=INFO, corruption=Corruption(), weights=w
        )
        assert torch.equal(got["input_ids"], reference["input_ids"]) and torch.equal(got["labels"], reference["labels"])
    # the blend itself at a = 0 is all ones, whatever the scores
    scores = normalise(
        torch.rand(8, 24, generator=torch.Generator().manual_seed(1)) * 5,
        eligible_positions(batch["input_ids"], INFO.special_ids),
        "mean",
    )
    ones = blend(scores, 0.0, 0.1)
    got = mask_batch(batch, seed=5, epoch_key=3, rate=0.15, info=INFO, corruption=Corruption(), weights=ones)
    assert torch.equal(got["labels"], reference["labels"])


def test_weights_follow_the_formula_and_normalisation():
    eligible = torch.tensor([[False, True, True, True, False]])
    scores = torch.tensor([[9.0, 1.0, 2.0, 3.0, 9.0]])
    s = normalise(scores, eligible, "mean")
    assert torch.allclose(s[eligible].mean(), torch.tensor(1.0))
    assert torch.allclose(s[eligible], torch.tensor([0.5, 1.0, 1.5]))
    assert torch.equal(normalise(scores, eligible, "raw"), scores)
    w = blend(s, 0.8, 0.5)
    assert torch.allclose(w[eligible], torch.tensor([0.6, 1.0, 1.4]).clamp(min=0.5))


def test_static_repeats_with_period_dupe_factor_and_dynamic_does_not():
    batch = make_batch(8, 32)

    def labels(strategy, epoch):
        return mask_batch(
            batch, seed=0, epoch_key=strategy.epoch_key(epoch), rate=0.15, info=INFO, corruption=Corruption()
        )["labels"]

    static = build_strategy(MaskingConfig(strategy="static", dupe_factor=3))
    masks = [labels(static, e) for e in range(7)]
    for e in range(4):
        assert torch.equal(masks[e], masks[e + 3])
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    dynamic = build_strategy(MaskingConfig(strategy="dynamic"))
    masks = [labels(dynamic, e) for e in range(7)]
    assert all(not torch.equal(a, b) for a, b in itertools.combinations(masks, 2))


# ----- scorers -----------------------------------------------------------------------------------


def test_chunked_entropy_and_max_prob_equal_the_full_softmax():
    model, batch = tiny_model(), make_batch(4, 20)
    eligible = eligible_positions(batch["input_ids"], INFO.special_ids)
    for w in (model.cls.predictions.decoder.weight,):
        with torch.no_grad():
            w.mul_(30.0)  # peaked distributions, so entropies differ across positions
    naive = naive_entropy_scores(model, batch, eligible, V)
    chunked = scorers.entropy_scores(model, batch, eligible, V, chunk=7)
    assert naive[eligible].std() > 0.01
    assert torch.allclose(chunked, naive, atol=1e-5, rtol=0)
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"]
        ).prediction_logits[..., :V]
    inv_max = 1 / torch.softmax(logits, -1).max(-1).values
    got = scorers.max_prob_scores(model, batch, eligible, V, chunk=5)
    assert torch.allclose(got[eligible], inv_max[eligible], rtol=1e-5)
    assert (got[~eligible] == 0).all()


class _StandInEncoder(torch.nn.Module):
    """Embeddings only: the memory question is about the B x T x V head, not the encoder."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 32)

    def forward(self, input_ids, attention_mask, token_type_ids, inputs_embeds=None):  # BertModel's arguments
        # BertModel's output, read by name: no pooled output, as a BertForMaskedLM's encoder has none
        return BaseModelOutputWithPoolingAndCrossAttentions(last_hidden_state=self.embed(input_ids))


def _largest_allocation(fn) -> int:
    """Bytes of the largest single CPU allocation any op made while ``fn`` ran (torch profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(event.cpu_memory_usage for event in prof.events())


def test_chunked_entropy_peak_memory_is_below_the_naive_one():
    vocab, rows, length = 30522, 16, 128
    model = torch.nn.Module()
    model.bert, model.cls = _StandInEncoder(vocab), torch.nn.Module()
    model.cls.predictions = torch.nn.Linear(32, vocab)
    model.config = BertConfig(vocab_size=vocab)  # what architectures.architecture_of reads: a BERT
    ids = torch.randint(5, vocab, (rows, length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    eligible = eligible_positions(ids, (0, 1, 2, 3, 4))
    naive = _largest_allocation(lambda: naive_entropy_scores(model, batch, eligible, vocab))
    chunked = _largest_allocation(lambda: scorers.entropy_scores(model, batch, eligible, vocab, chunk=256))
    full = rows * length * vocab * 4  # one (B, T, V) float32 tensor: 250 MiB
    assert naive >= full and chunked <= 256 * vocab * 4 * 2, (naive, chunked)


def test_grad_norm_scores_are_positive_where_eligible_and_leave_parameter_grads_alone():
    model, batch = tiny_model(), make_batch(4, 20)
    eligible = eligible_positions(batch["input_ids"], INFO.special_ids)
    scores = scorers.grad_norm_scores(model, batch, eligible, info=INFO, vocab_size=V, seed=0, key=1)
    assert (scores[eligible] > 0).all() and (scores[~eligible] == 0).all()
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(scores, scorers.grad_norm_scores(model, batch, eligible, info=INFO, vocab_size=V, seed=0, key=1))


def test_scoring_restores_training_mode_and_leaves_the_global_rng_alone():
    model = build_model(
        ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, dropout=0.1), V, 0
    ).train()  # dropout on: a training-mode forward would draw from the global RNG
    batch = make_batch(4, 20)
    state = torch.get_rng_state()
    strategy = build_strategy(adaptive(adapt_schedule="constant"), info=INFO, vocab_size=V)
    strategy.weights(model, batch, 0.5)
    assert model.training and torch.equal(state, torch.get_rng_state())


def test_loss_ema_and_context_learn_which_tokens_are_hard():
    batch = make_batch(16, 32)
    ids = batch["input_ids"]
    hard_id = int(ids[1, 3])
    for scorer in ("loss_ema", "context"):
        strategy = build_strategy(
            adaptive(scorer=scorer, adapt_schedule="constant", floor=0.01), info=INFO, vocab_size=V
        )
        assert strategy.weights(None, batch, 1.0) is not None  # untrained table: uniform weights
        masked = mask_batch(batch, seed=0, epoch_key=0, rate=0.9, info=INFO, corruption=Corruption())
        index = (masked["labels"] != -100).flatten().nonzero().squeeze(1)
        losses = torch.where(ids.flatten()[index] == hard_id, 50.0, 1.0)
        strategy.observe(masked, {"selected_index": index, "token_losses": losses})
        strategy.learn()
        w = strategy.weights(None, batch, 1.0)
        hard = ids == hard_id
        assert w[hard].min() > 5 * w[~hard & eligible_positions(ids, INFO.special_ids)].max()


def test_context_scores_separate_one_token_in_two_contexts():
    ids = torch.tensor([[2, 10, 50, 11, 3], [2, 20, 50, 21, 3]])  # token 50 after 10 (easy) and after 20 (hard)
    scorer = scorers.LossScorer("context", V, 0.9, 1 << 16)
    scorer.learn(scorer.observations(ids, torch.tensor([2, 7]), torch.tensor([0.5, 4.0])))
    scores = scorer.scores(ids)
    assert scores[0, 2] == pytest.approx(0.5) and scores[1, 2] == pytest.approx(4.0)
    ids_table = scorers.LossScorer("loss_ema", V, 0.9, 1)
    ids_table.learn(ids_table.observations(ids, torch.tensor([2, 7]), torch.tensor([0.5, 4.0])))
    assert ids_table.scores(ids)[0, 2] == ids_table.scores(ids)[1, 2]


# ----- schedules ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ADAPT_SCHEDULES)
def test_every_adapt_schedule_is_a_pure_function_within_zero_and_a_max(kind):
    grid = np.linspace(-0.2, 1.2, 141)
    for a_max in (1.0, 0.6):
        values = [adapt_factor(kind, p, a_max) for p in grid]
        assert values == [adapt_factor(kind, p, a_max) for p in grid]  # pure
        assert all(0.0 <= v <= a_max + 1e-12 for v in values)
        assert all(b >= a - 1e-12 for a, b in zip(values, values[1:]))  # non-decreasing
        assert adapt_factor(kind, 1.0, a_max) == pytest.approx(a_max)
        expected_start = a_max if kind == "constant" else 0.0
        assert adapt_factor(kind, 0.0, a_max) == pytest.approx(expected_start, abs=1e-12)


def test_adapt_schedule_shapes():
    assert adapt_shape("quadratic", 0.5) == pytest.approx(0.25)
    assert adapt_shape("linear", 0.3) == pytest.approx(0.3)
    assert adapt_shape("cosine", 0.5) == pytest.approx(0.5)
    assert adapt_shape("sigmoid", 0.5) == pytest.approx(0.5)
    assert adapt_shape("exponential", 0.5) < 0.1
    with pytest.raises(ValueError):
        adapt_shape("cubic", 0.5)


def test_rate_schedule_endpoints():
    assert rate_at(MaskingConfig(rate=0.15), 0.0) == rate_at(MaskingConfig(rate=0.15), 1.0) == 0.15
    cfg = MaskingConfig(rate_schedule="linear_decay", rate=0.15, rate_start=0.30)
    assert rate_at(cfg, 0.0) == pytest.approx(0.30) and rate_at(cfg, 1.0) == pytest.approx(0.15)
    assert rate_at(cfg, 0.5) == pytest.approx(0.225) and rate_at(cfg, 2.0) == pytest.approx(0.15)
    assert mask_rate("linear_decay", -1.0, 0.15, 0.3) == pytest.approx(0.3)


# ----- whole words -------------------------------------------------------------------------------


def test_whole_word_masking_selects_whole_words_at_the_right_rate(bert_tokenizer, sample_paragraphs):
    info = token_info_for(bert_tokenizer)
    table = continuation_table(bert_tokenizer)
    assert (
        table[bert_tokenizer.convert_tokens_to_ids("##ing")] and not table[bert_tokenizer.convert_tokens_to_ids("the")]
    )
    enc = bert_tokenizer(
        sample_paragraphs[:300], truncation=True, max_length=128, padding="max_length", return_tensors="pt"
    )
    ids = enc["input_ids"]
    batch = {"input_ids": ids, "example_ids": torch.arange(len(ids))}
    masked = mask_batch(
        batch, seed=2, epoch_key=0, rate=0.15, info=info, corruption=Corruption(), whole_word=True, continuation=table
    )
    selected = masked["labels"] != -100
    eligible = eligible_positions(ids, info.special_ids)
    cont = table[ids] & torch.roll(eligible, 1, 1)
    cont[:, 0] = False
    assert not (selected & ~eligible).any()
    # a continuation piece is selected exactly when the piece before it is
    assert torch.equal(selected[:, 1:][cont[:, 1:]], selected[:, :-1][cont[:, 1:]])
    ratio = selected.sum() / count_to_select(eligible, 0.15).sum()
    assert 0.97 < float(ratio) < 1.03
    assert selected.sum(1).min() >= 1
    uniform = mask_batch(batch, seed=2, epoch_key=0, rate=0.15, info=info, corruption=Corruption())
    uniform_sel = uniform["labels"] != -100
    assert not torch.equal(selected, uniform_sel)
    assert (uniform_sel[:, 1:] & cont[:, 1:] & ~uniform_sel[:, :-1]).any()  # word pieces split without it


# ----- observability and resume -----------------------------------------------------------------


def test_frequency_buckets_by_rank_drop_cut_offs_beyond_the_vocabulary():
    counts = np.array([5, 90, 0, 40, 7, 60, 1, 3])  # ranks: id 1, 5, 3, 4, 0, 7, 6, 2
    bucket_of, names = frequency_buckets(counts, (2, 5, 8, 20), vocab_size=8)
    assert names == ["0_2", "2_5", "5_rest"]  # cut-offs 8 and 20 would open empty buckets
    assert bucket_of.tolist() == [1, 0, 2, 1, 1, 0, 2, 2]


def test_stats_report_a_scores_cost_and_frequency_shares():
    counts = np.arange(V, 0, -1)  # id 0 most frequent
    cfg = adaptive(scorer="entropy", adapt_schedule="linear", freq_buckets="50,150")
    strategy = build_strategy(cfg, info=INFO, vocab_size=V, token_counts=counts)
    model, batch = tiny_model(), make_batch()
    w = strategy.weights(model, batch, 0.5)
    masked = mask_batch(batch, seed=0, epoch_key=0, rate=0.15, info=INFO, corruption=Corruption(), weights=w)
    strategy.observe(masked, pretraining_loss(model, masked))
    stats = strategy.stats()
    assert stats["mask_a"] == pytest.approx(0.5)
    assert stats["mask_score_eligible"] == pytest.approx(1.0, abs=1e-5) and stats["mask_score_selected"] > 0
    assert stats["mask_score_seconds"] > 0 and stats["mask_scored_steps"] == 1
    shares = [stats[f"mask_share_freq_{n}"] for n in ("0_50", "50_150", "150_rest")]
    assert sum(shares) == pytest.approx(1.0)
    assert strategy.stats()["mask_scored_steps"] == 0  # a window: reset by each call
    uniform = build_strategy(MaskingConfig(), vocab_size=V, token_counts=counts)
    uniform.observe(masked, {"selected_index": (masked["labels"] != -100).flatten().nonzero().squeeze(1)})
    assert sum(uniform.stats().values()) == pytest.approx(1.0)


def test_score_every_and_fraction_control_cost():
    model, batch = tiny_model(), make_batch()
    strategy = build_strategy(
        adaptive(adapt_schedule="constant", score_every=3, score_fraction=0.5), info=INFO, vocab_size=V
    )
    got = [strategy.weights(model, batch, 0.5, step=step) for step in range(1, 7)]
    assert [w is not None for w in got] == [True, False, False, True, False, False]
    uniform_rows = (got[0] == 1).all(dim=1)  # (B,) the rows not scored
    assert 0 < int(uniform_rows.sum()) < len(uniform_rows)


def test_the_scored_rows_do_not_depend_on_how_the_batch_is_split():
    """score_fraction draws each sequence's fate from its example id, as two processes or micro-batches would."""
    model, batch = tiny_model(), make_batch(16)
    cfg = adaptive(adapt_schedule="constant", score_fraction=0.5)
    whole = build_strategy(cfg, info=INFO, vocab_size=V).weights(model, batch, 0.5, epoch_key=3)
    halves = [
        build_strategy(cfg, info=INFO, vocab_size=V).weights(
            model, {key: value[part] for key, value in batch.items()}, 0.5, epoch_key=3
        )
        for part in (slice(0, 8), slice(8, 16))
    ]
    torch.testing.assert_close(torch.cat(halves), whole, rtol=1e-5, atol=1e-6)
    strategy = build_strategy(cfg, info=INFO, vocab_size=V)
    many = {"example_ids": torch.arange(4000)}
    assert strategy._scored_rows(many, 0).float().mean().item() == pytest.approx(0.5, abs=0.03)  # 4 standard errors
    assert not torch.equal(strategy._scored_rows(many, 0), strategy._scored_rows(many, 1))  # other rows each epoch


def test_a_steps_micro_batches_are_scored_alike_whatever_the_split():
    """score_every and grad_norm's masks follow the optimizer step, not how many micro-batches came before."""
    model, batch = tiny_model(), make_batch(16)
    cfg = adaptive(scorer="grad_norm", adapt_schedule="constant", score_every=2)
    strategy = build_strategy(cfg, info=INFO, vocab_size=V)
    halves = [{key: value[part] for key, value in batch.items()} for part in (slice(0, 8), slice(8, 16))]
    scored = [strategy.weights(model, half, 0.5, step=step) is not None for step in (1, 2, 3) for half in halves]
    assert scored == [True, True, False, False, True, True]  # two micro-batches per step: both or neither
    whole = build_strategy(cfg, info=INFO, vocab_size=V).weights(model, batch, 0.5, step=3)
    split = [build_strategy(cfg, info=INFO, vocab_size=V).weights(model, half, 0.5, step=3) for half in halves]
    torch.testing.assert_close(torch.cat(split), whole, rtol=1e-5, atol=1e-6)
    other_step = build_strategy(cfg, info=INFO, vocab_size=V).weights(model, batch, 0.5, step=5)
    assert not torch.equal(other_step, whole)  # grad_norm's masked copy is drawn anew each step


@pytest.mark.parametrize(
    "scorer,extra",
    [
        ("context", {}),
        ("loss_ema", {}),
        ("entropy", {"score_every": 2}),
        ("frequency", {}),
        ("loss_ema", {"frequency_neutral": True, "freq_buckets": "50,150"}),
    ],
)
def test_state_round_trip_reproduces_the_uninterrupted_run(scorer, extra):
    cfg = adaptive(scorer=scorer, adapt_schedule="linear", context_buckets=4096, **extra)
    model = tiny_model()
    batches = [make_batch(6, 20, seed=s) for s in range(6)]

    def run(strategy, steps, start=0):
        out = []
        for step in steps:
            batch = batches[step]
            w = strategy.weights(model, batch, step / 6, step=step + 1)
            masked = mask_batch(
                batch,
                seed=0,
                epoch_key=strategy.epoch_key(0),
                rate=0.3,
                info=INFO,
                corruption=Corruption(),
                weights=w,
                groups=strategy.selection_groups(batch),
            )
            strategy.observe(masked, pretraining_loss(model, masked))
            strategy.learn()
            out.append((w, masked["input_ids"], masked["labels"]))
        return out

    whole = run(build_strategy(cfg, info=INFO, vocab_size=V, token_counts=COUNTS), range(6))
    first = build_strategy(cfg, info=INFO, vocab_size=V, token_counts=COUNTS)
    run(first, range(3))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # tensors only: loadable with weights_only=True
    buffer.seek(0)
    resumed = build_strategy(cfg, info=INFO, vocab_size=V, token_counts=COUNTS)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    rest = run(resumed, range(3, 6))
    for (w1, i1, l1), (w2, i2, l2) in zip(whole[3:], rest):
        assert (w1 is None and w2 is None) or torch.equal(w1, w2)
        assert torch.equal(i1, i2) and torch.equal(l1, l2)
    if scorer != "entropy":
        assert any(w is not None and not torch.all(w == w[0, 1]) for w, _, _ in rest)  # the tables matter
    legacy = {**first.state_dict(), "step": torch.tensor(3)}  # checkpoints from before the trainer's step drove scoring
    build_strategy(cfg, info=INFO, vocab_size=V, token_counts=COUNTS).load_state_dict(legacy)
    with pytest.raises(UserError):
        build_strategy(adaptive(scorer="context", context_buckets=8), info=INFO, vocab_size=V).load_state_dict(
            copy.deepcopy(first.state_dict()) if scorer == "context" else {"step": torch.tensor(1)}
        )


def test_masking_config_validation_says_what_to_change():
    for bad in (
        {"scorer": "oracle"},
        {"adapt_schedule": "cubic"},
        {"floor": 0.0},
        {"a_max": 1.5},
        {"normalize": "softmax"},
        {"score_every": 0},
        {"rate_schedule": "step"},
        {"freq_buckets": "10,5"},
        {"frequency_neutral": True},
        {"frequency_neutral": True, "strategy": "adaptive", "whole_word": True},
    ):
        with pytest.raises(UserError) as err:
            Config(masking=MaskingConfig(**bad))
        assert "\n" not in str(err.value) and "masking." in str(err.value)
    json.dumps(Config().masking.__dict__)  # defaults run and serialise


# ----- frequency controls: the frequency scorer and frequency-neutral ADM --------------------------


def frequency_neutral(**overrides):
    return adaptive(frequency_neutral=True, freq_buckets="50,150", **overrides)


def per_group(selected, groups, num_groups=3):
    """(..., G) selected positions of each group per row; selected and groups (..., T)."""
    counts = torch.zeros(*selected.shape[:-1], num_groups, dtype=torch.long)
    return counts.scatter_add_(-1, groups, selected.long())


def test_frequency_scores_rank_rarer_ids_higher_and_are_never_negative():
    counts = np.array([0, 7, 3, 3, 120, 1, 50])  # shorter than the vocabulary of 10: ids 7-9 unseen
    scores = scorers.FrequencyScorer(counts, 10).scores(torch.arange(10)[None])[0]  # (V,)
    full = np.concatenate([counts, [0, 0, 0]])
    for i, j in itertools.permutations(range(10), 2):
        if full[i] < full[j]:
            assert scores[i] > scores[j], (i, j)  # strictly monotone in the count
        elif full[i] == full[j]:
            assert scores[i] == scores[j]
    assert torch.isfinite(scores).all() and (scores >= 0).all() and scores[0] == scores.max()
    expected = -np.log((full + 1) / (full.sum() + 10))  # add-one smoothed unigram surprisal
    assert torch.allclose(scores.double(), torch.from_numpy(expected), atol=1e-5)
    assert scorers.FrequencyScorer([5], 1).scores(torch.zeros(1, 1, dtype=torch.long)).item() == 0.0  # p = 1


def test_adm_with_the_frequency_scorer_targets_rare_ids_more_than_uniform():
    batch = make_batch(16, 32)
    strategy = build_strategy(
        adaptive(scorer="frequency", adapt_schedule="constant"), info=INFO, vocab_size=V, token_counts=COUNTS
    )
    weights = strategy.weights(None, batch, 1.0)

    def rare_share(w):
        labels = torch.stack(
            [
                mask_batch(batch, seed=2, epoch_key=e, rate=0.15, info=INFO, corruption=Corruption(), weights=w)[
                    "labels"
                ]
                for e in range(100)
            ]
        )
        return float((labels >= 150).sum() / (labels != -100).sum())

    adm, uniform = rare_share(weights), rare_share(None)
    assert adm > uniform + 0.03, (adm, uniform)  # about 10 standard errors at these sizes


def test_cost_controls_fsdp_and_budget_spare_the_frequency_scorer():
    batch = make_batch()
    cfg = adaptive(scorer="frequency", adapt_schedule="constant", score_every=3, score_fraction=0.5)
    strategy = build_strategy(cfg, info=INFO, vocab_size=V, token_counts=COUNTS)
    for step in range(1, 5):  # every step scored, every row: score_every and score_fraction price model passes only
        w = strategy.weights(None, batch, 0.5, step=step)
        assert w is not None and all(w[row, 1:-1].std() > 0 for row in range(len(w)))
    assert set(strategy.state_dict()) == {"score_seconds_total"}  # nothing learnt, nothing to checkpoint
    with pytest.raises(ValueError):
        build_strategy(cfg, info=INFO, vocab_size=V)  # no corpus counts, no frequency scores
    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True)
    for scorer in ("frequency", "loss_ema", "context"):
        check_fsdp(fsdp, Config(masking=adaptive(scorer=scorer)))  # not refused
        assert scorer_flops(Config(masking=adaptive(scorer=scorer, score_every=2)), 1e9, V) == 0.0
    with pytest.raises(UserError, match="needs the whole model"):
        check_fsdp(fsdp, Config(masking=adaptive(scorer="entropy")))
    assert scorer_flops(Config(masking=adaptive(scorer="entropy")), 1e9, V) > 0


def test_group_quotas_sum_to_k_and_round_each_share_down_or_up():
    counts = torch.tensor([[3, 4, 0], [0, 7, 2], [5, 0, 0], [1, 1, 1], [0, 0, 0]])  # (B, G) eligible per group
    k = torch.tensor([3, 3, 2, 1, 0])
    share = k[:, None] * counts / counts.sum(1, keepdim=True).clamp(min=1)  # (B, G) k * n_g / n
    mean = torch.zeros_like(share, dtype=torch.float64)
    grid = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000
    for u in [*grid, torch.tensor(1 - 2**-25, dtype=torch.float64)]:  # the largest uniform seeding can give
        quotas = group_quotas(counts, k, torch.full((5,), float(u), dtype=torch.float64))
        assert torch.equal(quotas.sum(1), k)
        assert ((quotas == share.floor()) | (quotas == share.ceil())).all()
        mean += quotas / (len(grid) + 1)
    assert torch.allclose(mean, share.double(), atol=2e-3)  # E[k_g] = k * n_g / n over u


def test_frequency_neutral_keeps_the_uniform_expectation_per_bucket_where_plain_adm_does_not():
    batch, draws = make_batch(8, 40), 2000
    strategy = build_strategy(frequency_neutral(), info=INFO, vocab_size=V, token_counts=COUNTS)
    ids, groups = batch["input_ids"], strategy.selection_groups(batch)  # (B, T)
    eligible = eligible_positions(ids, INFO.special_ids)
    weights = torch.where(eligible & (groups == 0), 50.0, 1.0)  # far from uniform: 50x on the frequent bucket
    k = count_to_select(eligible, 0.15)  # (B,)
    n_g = per_group(eligible, groups).double()  # (B, G)
    expected = k[:, None] * n_g / n_g.sum(1, keepdim=True)  # uniform masking's expectation

    def targets(with_groups):  # (R, B, G): R draws at once, one epoch key each, rows repeated
        rows = torch.arange(8).repeat(draws)
        _, _, selected = select_and_corrupt(
            ids[rows],
            batch["example_ids"][rows],
            torch.arange(draws).repeat_interleave(8),
            seed=3,
            rate=0.15,
            info=INFO,
            corruption=Corruption(),
            weights=weights[rows],
            groups=groups[rows] if with_groups else None,
        )
        assert torch.equal(selected.sum(1), k[rows]) and not (selected & ~eligible[rows]).any()  # k, never a special
        return per_group(selected, groups[rows]).view(draws, 8, 3).double()

    neutral, plain = targets(True), targets(False)
    se = neutral.std(0) / draws**0.5
    assert ((neutral.mean(0) - expected).abs() <= 4 * se + 1e-9).all(), (neutral.mean(0), expected)
    assert ((neutral == expected.floor()) | (neutral == expected.ceil())).all()
    plain_se = plain.std(0) / draws**0.5
    assert ((plain.mean(0) - expected)[:, 0] > 20 * plain_se[:, 0] + 0.5).all()  # the test can fail: plain ADM shifts


def test_frequency_neutral_applies_the_quotas_with_every_scorer_and_at_uniform_steps():
    batch, model = make_batch(8, 40), tiny_model()
    ids = batch["input_ids"]
    eligible = eligible_positions(ids, INFO.special_ids)
    for scorer, progress in [
        (name, 1.0) for name in ("entropy", "max_prob", "grad_norm", "loss_ema", "context", "frequency")
    ] + [("entropy", 0.0)]:
        strategy = build_strategy(frequency_neutral(scorer=scorer), info=INFO, vocab_size=V, token_counts=COUNTS)
        w = strategy.weights(model, batch, progress)
        assert (w is None) == (progress == 0.0)  # a = 0: uniform weights, still stratified
        groups = strategy.selection_groups(batch)
        labels = mask_batch(
            batch, seed=1, epoch_key=4, rate=0.15, info=INFO, corruption=Corruption(), weights=w, groups=groups
        )["labels"]
        selected = labels != -100
        k, n_g = count_to_select(eligible, 0.15), per_group(eligible, groups)
        share = k[:, None] * n_g / n_g.sum(1, keepdim=True)
        got = per_group(selected, groups)
        assert torch.equal(selected.sum(1), k) and not (selected & ~eligible).any()
        assert ((got == share.floor()) | (got == share.ceil())).all(), scorer


def test_frequency_neutral_chooses_within_a_bucket_by_weight_with_exact_probabilities():
    rows = 40_000
    ids = torch.tensor([2, 10, 20, 30, 60, 70, 80, 90, 3])  # [CLS], 3 ids of bucket 0, 4 of bucket 1, [SEP]
    weights = torch.tensor([1.0, 1.0, 4.0, 0.5, 1.0, 2.0, 3.0, 0.5, 1.0])
    strategy = build_strategy(frequency_neutral(), info=INFO, vocab_size=V, token_counts=COUNTS)
    groups = strategy.selection_groups({"input_ids": ids[None]})[0]
    assert groups[1:-1].tolist() == [0, 0, 0, 1, 1, 1, 1]
    _, _, selected = select_and_corrupt(
        ids.expand(rows, -1),
        torch.arange(rows),
        torch.zeros(rows, dtype=torch.long),
        seed=9,
        rate=0.43,
        info=INFO,
        corruption=Corruption(),
        weights=weights.expand(rows, -1),
        groups=groups.expand(rows, -1),
    )
    empirical = selected.float().mean(0).numpy()
    # k = 3 of 7; bucket 0's quota 3 * 3/7 = 9/7: 2 targets with probability 2/7, else 1; bucket 1 gets the rest
    p2 = 2 / 7
    first = (1 - p2) * exact_inclusion([1.0, 4.0, 0.5], 1) + p2 * exact_inclusion([1.0, 4.0, 0.5], 2)
    second = p2 * exact_inclusion([1.0, 2.0, 3.0, 0.5], 1) + (1 - p2) * exact_inclusion([1.0, 2.0, 3.0, 0.5], 2)
    exact = np.concatenate([[0.0], first, second, [0.0]])
    sigma = np.sqrt(exact * (1 - exact) / rows)
    assert np.all(np.abs(empirical - exact) < 4.5 * sigma + 1e-9), (empirical, exact)
    assert empirical[2] > empirical[1] > empirical[3] and empirical[6] > empirical[5] > empirical[4] > empirical[7]


def test_frequency_neutral_masks_depend_on_seed_example_and_epoch_only():
    strategy = build_strategy(frequency_neutral(), info=INFO, vocab_size=V, token_counts=COUNTS)
    full = make_batch(8, 24, seed=1)

    def masks(batch, epoch):
        weights = 1.0 + (batch["input_ids"] % 7).float()  # row-local, as ADM's per-row normalised weights are
        return mask_batch(
            batch,
            seed=4,
            epoch_key=epoch,
            rate=0.3,
            info=INFO,
            corruption=Corruption(),
            weights=weights,
            groups=strategy.selection_groups(batch),
        )

    whole = masks(full, 2)
    picked = [5, 2, 7]  # another batch: other rows, another order, padded to a longer length
    other = {key: value[picked] for key, value in full.items()}
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        other[key] = torch.nn.functional.pad(other[key], (0, 6))  # [PAD] = 0
    part = masks(other, 2)
    for key in ("input_ids", "labels"):
        assert torch.equal(part[key][:, :24], whole[key][picked])
    assert (part["labels"][:, 24:] == -100).all()
    assert torch.equal(masks(full, 2)["labels"], whole["labels"])
    assert not torch.equal(masks(full, 3)["labels"], whole["labels"])  # dynamic: a new epoch, new masks
    off = build_strategy(adaptive(freq_buckets="50,150"), info=INFO, vocab_size=V, token_counts=COUNTS)
    assert off.selection_groups(full) is None  # default off: the masks of every existing setting stay as they were
