"""Batched sampler: processed distributions, exact sampling, seeding, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from turbospec.sampler import SamplingBatch, compute_logprobs, make_generator, processed_probs, sample
from turbospec.sampling_params import SamplingParams

# The canonical nucleus example; put in a scrambled order so that a sampler
# that forgets to un-sort its mask puts mass on the wrong token ids.
BASE_PROBS = [0.5, 0.3, 0.15, 0.05]
PERM = [2, 0, 3, 1]  # BASE_PROBS[j] lives at token id PERM[j]


def scrambled_logits(probs: Sequence[float] = BASE_PROBS, perm: Sequence[int] = PERM) -> torch.Tensor:
    logits = torch.empty(len(probs))
    for p, token in zip(probs, perm):
        logits[token] = math.log(p)
    return logits


def scrambled(values: Sequence[float], perm: Sequence[int] = PERM) -> torch.Tensor:
    out = torch.zeros(len(perm))
    for v, token in zip(values, perm):
        out[token] = v
    return out


def build(params: Sequence[SamplingParams], vocab: int, seeds: Sequence[int] | None = None) -> SamplingBatch:
    if seeds is None:
        seeds = list(range(len(params)))
    gens = [None if p.greedy else make_generator(s) for p, s in zip(params, seeds)]
    return SamplingBatch.build(params, gens, vocab)


def probs_for(logits: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """processed_probs of a single row with the given params."""
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    return processed_probs(logits.unsqueeze(0), build([params], logits.shape[-1]))[0]


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Slow, obviously-correct per-row reference in float64."""
    vocab = logits.shape[-1]
    if p.greedy:
        out = torch.zeros(vocab, dtype=torch.float64)
        out[int(logits.argmax())] = 1.0
        return out
    probs = torch.softmax(logits.double() / p.temperature, dim=-1).tolist()
    order = sorted(range(vocab), key=lambda i: (-probs[i], i))
    kept = order[: p.top_k] if p.top_k > 0 else order
    if p.top_p < 1.0:
        total = sum(probs[i] for i in kept)
        nucleus: list[int] = []
        mass = 0.0
        for i in kept:
            nucleus.append(i)
            mass += probs[i] / total
            if mass >= p.top_p:
                break
        kept = nucleus
    total = sum(probs[i] for i in kept)
    renorm = {i: probs[i] / total for i in kept}
    top = max(renorm.values())
    kept = [i for i in kept if renorm[i] >= p.min_p * top]
    out = torch.zeros(vocab, dtype=torch.float64)
    for i in kept:
        out[i] = probs[i]
    return out / out.sum()


# --------------------------------------------------------------------------
# processed_probs
# --------------------------------------------------------------------------


def test_greedy_is_one_hot_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 4.0]])
    # Truncation params must not matter for greedy rows.
    params = [SamplingParams(temperature=0.0, top_k=1, top_p=0.1), SamplingParams(temperature=0.0)]
    batch = build(params, 4)
    assert batch.all_greedy
    probs = processed_probs(logits, batch)
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(sample(probs, batch), torch.tensor([1, 0]))


def test_temperature_scaling_matches_softmax() -> None:
    logits = torch.tensor([1.0, -0.5, 2.0, 0.3, 0.0])
    for temperature in (0.3, 1.0, 2.5):
        expected = torch.softmax(logits / temperature, dim=-1)
        torch.testing.assert_close(probs_for(logits, temperature=temperature), expected)


def test_top_k_keeps_exactly_k_and_renormalises() -> None:
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0, 1.0, 2.5, 0.0, -2.0])
    got = probs_for(logits, top_k=3)
    keep = [1, 5, 3]  # ids of the three largest logits
    expected = torch.zeros(8)
    expected[keep] = torch.softmax(logits[keep], dim=-1)
    torch.testing.assert_close(got, expected)
    assert int((got > 0).sum()) == 3


def test_top_k_with_ties_still_keeps_exactly_k() -> None:
    got = probs_for(torch.zeros(6), top_k=2)
    assert int((got > 0).sum()) == 2
    torch.testing.assert_close(got.sum(), torch.tensor(1.0))


def test_top_k_larger_than_vocab_is_noop() -> None:
    logits = torch.tensor([0.2, 1.0, -0.3])
    torch.testing.assert_close(probs_for(logits, top_k=50), torch.softmax(logits, dim=-1))


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.8, [0.5, 0.3]),  # 0.5 + 0.3 reaches 0.8 exactly: the third is not needed
        (0.81, [0.5, 0.3, 0.15]),
        (0.5, [0.5]),
        (0.01, [0.5]),  # always at least one token
        (0.96, [0.5, 0.3, 0.15, 0.05]),
        (1.0, [0.5, 0.3, 0.15, 0.05]),
    ],
)
def test_top_p_known_distribution(top_p: float, kept: list[float]) -> None:
    got = probs_for(scrambled_logits(), top_p=top_p)
    expected = scrambled([v / sum(kept) for v in kept])
    torch.testing.assert_close(got, expected)


def test_top_p_example_values() -> None:
    got = probs_for(scrambled_logits(), top_p=0.8)
    torch.testing.assert_close(got, scrambled([0.625, 0.375]))


@pytest.mark.parametrize(
    ("min_p", "kept"),
    [
        (0.2, [0.5, 0.3, 0.15]),  # threshold 0.1
        (0.5, [0.5, 0.3]),  # threshold 0.25
        (0.7, [0.5]),  # threshold 0.35
        (1.0, [0.5]),
        (0.05, [0.5, 0.3, 0.15, 0.05]),  # threshold 0.025
    ],
)
def test_min_p(min_p: float, kept: list[float]) -> None:
    got = probs_for(scrambled_logits(), min_p=min_p)
    expected = scrambled([v / sum(kept) for v in kept])
    torch.testing.assert_close(got, expected)


def test_top_k_is_applied_before_top_p() -> None:
    probs = [0.4, 0.3, 0.2, 0.1]
    logits = scrambled_logits(probs)
    # Alone, top_p=0.5 needs two tokens (0.4 < 0.5).
    torch.testing.assert_close(probs_for(logits, top_p=0.5), scrambled([4 / 7, 3 / 7]))
    # After top_k=2 renormalises to [4/7, 3/7], the first token alone covers 0.5.
    torch.testing.assert_close(probs_for(logits, top_k=2, top_p=0.5), scrambled([1.0]))


def test_temperature_is_applied_before_top_p() -> None:
    logits = scrambled_logits()
    # At T=0.5 the distribution sharpens to ~[0.69, 0.25, 0.06, 0.007]: top_p 0.8
    # now needs two tokens whose renormalised ratio is 0.5^2 : 0.3^2.
    expected = scrambled([0.25 / 0.34, 0.09 / 0.34])
    torch.testing.assert_close(probs_for(logits, temperature=0.5, top_p=0.8), expected)


def test_mixed_batch_each_row_gets_its_own_distribution() -> None:
    logits_row = scrambled_logits()
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.8),
        SamplingParams(top_k=3),
        SamplingParams(min_p=0.5),
        SamplingParams(temperature=2.0),
        SamplingParams(),
        SamplingParams(top_p=0.81, top_k=2),
    ]
    base = torch.tensor(BASE_PROBS)
    hot = base.sqrt() / base.sqrt().sum()
    expected = torch.stack(
        [
            scrambled([1.0]),
            scrambled([0.625, 0.375]),
            scrambled([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95]),
            scrambled([0.625, 0.375]),
            scrambled(hot.tolist()),
            scrambled(BASE_PROBS),
            scrambled([0.625, 0.375]),
        ]
    )
    logits = logits_row.expand(len(params), -1).clone()
    got = processed_probs(logits, build(params, 4))
    torch.testing.assert_close(got, expected)


def test_random_mixed_batch_matches_reference() -> None:
    rng = torch.Generator().manual_seed(0)
    vocab, rows = 12, 40
    logits = torch.randn(rows, vocab, generator=rng) * 2
    params = []
    for i in range(rows):
        u = torch.rand(4, generator=rng).tolist()
        params.append(
            SamplingParams(
                temperature=0.0 if i % 7 == 0 else 0.2 + 2 * u[0],
                top_k=[-1, 1, 3, 8, 20][i % 5],
                top_p=[1.0, 0.9, 0.5, u[1]][i % 4] or 1.0,
                min_p=[0.0, 0.0, 0.1, u[2] * 0.5][i % 4],
            )
        )
    got = processed_probs(logits, build(params, vocab))
    expected = torch.stack([reference_probs(logits[i], p) for i, p in enumerate(params)])
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-5)


def test_rows_without_top_p_keep_their_tail_exactly() -> None:
    # A tail token far below any float tolerance must survive in a top_p=1 row
    # even when another row in the batch triggers the nucleus path.
    logits = torch.tensor([[0.0, 0.0, -25.0], [0.0, 0.0, -25.0]])
    params = [SamplingParams(top_p=0.3), SamplingParams()]
    got = processed_probs(logits, build(params, 3))
    torch.testing.assert_close(got[1], torch.softmax(logits[1], dim=-1))
    assert got[1, 2] > 0


def test_no_sort_when_nothing_truncates(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("sorted although no row uses top-k / top-p")

    monkeypatch.setattr(torch.Tensor, "sort", forbidden)
    monkeypatch.setattr(torch, "sort", forbidden)
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.7), SamplingParams(min_p=0.1), SamplingParams(top_k=7)]
    got = processed_probs(logits, build(params, 7))
    torch.testing.assert_close(got[0], torch.softmax(logits[0] / 0.7, dim=-1))


def test_output_is_float32_distribution_for_half_logits() -> None:
    logits = torch.randn(2, 9, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=4, temperature=0.5)]
    got = processed_probs(logits, build(params, 9))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.sum(-1), torch.ones(2))


def test_build_validates_generators() -> None:
    with pytest.raises(ValueError, match="generator"):
        SamplingBatch.build([SamplingParams()], [None], 4)
    with pytest.raises(ValueError, match="generator"):
        SamplingBatch.build([SamplingParams(), SamplingParams()], [make_generator(0)], 4)
    batch = SamplingBatch.build([SamplingParams(temperature=0)], [None], 4)
    assert batch.all_greedy
    assert batch.top_k.tolist() == [4]


def test_build_packs_tensors() -> None:
    params = [SamplingParams(temperature=0.5, top_k=2, top_p=0.9, min_p=0.1), SamplingParams(temperature=0)]
    batch = build(params, 10)
    assert batch.temperature.dtype == torch.float32
    assert batch.top_k.dtype == torch.int64
    assert batch.top_k.tolist() == [2, 10]
    assert batch.greedy.tolist() == [False, True]
    assert batch.generators[1] is None
    assert not batch.all_greedy


# --------------------------------------------------------------------------
# sample: exactness and seeding
# --------------------------------------------------------------------------


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = float(counts.sum())
    support = probs > 0
    expected = probs[support].double() * n
    return float(((counts[support].double() - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 4},
        {"temperature": 1.3, "top_p": 0.85, "min_p": 0.05},
    ],
)
def test_sample_matches_processed_probs(kwargs: dict[str, float]) -> None:
    vocab, draws = 6, 20_000
    logits_row = torch.tensor([0.3, 1.2, -0.4, 0.9, 0.0, -1.5])
    params = SamplingParams(seed=7, **kwargs)  # type: ignore[arg-type]
    # One shared generator over many identical rows: each row is an
    # independent draw, and one call keeps the test fast.
    gen = make_generator(params.seed)
    batch = SamplingBatch.build([params] * draws, [gen] * draws, vocab)
    logits = logits_row.expand(draws, -1)
    probs = processed_probs(logits, batch)
    tokens = sample(probs, batch)
    counts = torch.bincount(tokens, minlength=vocab)

    target = probs[0]
    assert int(counts[target == 0].sum()) == 0, "sampled a token with zero probability"
    # df <= 5; P(chi2_5 > 40) ~ 1.5e-7, and the seed is fixed anyway.
    assert chi_square(counts, target) < 40.0
    # Power check: the same counts must clearly reject the raw softmax
    # whenever the processed distribution differs from it.
    raw = torch.softmax(logits_row, dim=-1)
    if (target - raw).abs().max() > 0.02:
        assert chi_square(counts, raw) > 100.0


def test_sample_greedy_rows_take_argmax_in_mixed_batch() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    batch = build(params, 3)
    tokens = sample(processed_probs(logits, batch), batch)
    assert tokens[0] == 1 and tokens[2] == 2
    assert tokens.dtype == torch.int64 and tokens.shape == (3,)


def test_sample_one_token_support_is_deterministic() -> None:
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(top_k=1, seed=i) for i in range(50)]
    batch = build(params, 8, seeds=range(50))
    assert torch.equal(sample(processed_probs(logits, batch), batch), logits.argmax(-1))


def run_steps(
    target: SamplingParams,
    position: int,
    others: Sequence[tuple[SamplingParams, int]],
    steps: int = 12,
    vocab: int = 40,
) -> list[int]:
    """Decode `steps` tokens for `target` placed at row `position` among `others`."""
    logits_gen = torch.Generator().manual_seed(99)  # same target logits every run
    other_gen = torch.Generator().manual_seed(position + 1000)  # batch-mates vary
    target_gen = make_generator(target.seed)
    other_gens = [None if p.greedy else make_generator(s) for p, s in others]
    params = [p for p, _ in others]
    gens: list[torch.Generator | None] = list(other_gens)
    params.insert(position, target)
    gens.insert(position, target_gen)
    out: list[int] = []
    for _ in range(steps):
        target_logits = torch.randn(vocab, generator=logits_gen)
        logits = torch.randn(len(params), vocab, generator=other_gen)
        logits[position] = target_logits
        batch = SamplingBatch.build(params, gens, vocab)
        out.append(int(sample(processed_probs(logits, batch), batch)[position]))
    return out


def test_seeded_row_independent_of_batch_and_position() -> None:
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = run_steps(target, 0, [])
    others = [
        (SamplingParams(temperature=1.5, seed=1), 1),
        (SamplingParams(temperature=0), 0),
        (SamplingParams(top_k=3, seed=5), 5),
        (SamplingParams(min_p=0.2), 77),
    ]
    assert run_steps(target, 2, others) == alone
    assert run_steps(target, 4, others) == alone
    assert run_steps(target, 0, others[::-1]) == alone
    assert len(set(alone)) > 1  # it really sampled


def test_different_seeds_give_different_sequences() -> None:
    seqs = {tuple(run_steps(SamplingParams(temperature=1.0, seed=s), 0, [])) for s in range(4)}
    assert len(seqs) == 4


def test_make_generator() -> None:
    a = torch.rand(4, generator=make_generator(5))
    assert torch.equal(a, torch.rand(4, generator=torch.Generator().manual_seed(5)))
    assert torch.equal(a, torch.rand(4, generator=make_generator(5)))
    # torch ignores the high seed bits; make_generator must not.
    assert not torch.equal(torch.rand(4, generator=make_generator(5 + 2**32)), a)
    torch.rand(1, generator=make_generator(-3))
    torch.rand(1, generator=make_generator(2**80))
    unseeded = [torch.rand(4, generator=make_generator(None)) for _ in range(5)]
    assert len({tuple(t.tolist()) for t in unseeded}) == 5


# --------------------------------------------------------------------------
# compute_logprobs
# --------------------------------------------------------------------------


def test_compute_logprobs() -> None:
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(4)) * 3
    tokens = torch.tensor([0, 3, 10, 7, 7])
    chosen, top_vals, top_ids = compute_logprobs(logits, tokens, 4)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(chosen, ref[torch.arange(5), tokens])
    assert top_vals.shape == (5, 4) and top_ids.shape == (5, 4)
    assert top_ids.dtype == torch.int64
    assert bool((top_vals[:, :-1] >= top_vals[:, 1:]).all())
    torch.testing.assert_close(top_vals, ref.gather(-1, top_ids))
    assert torch.equal(top_ids[:, 0], logits.argmax(-1))
    # The best 4 really are the best 4.
    assert torch.equal(top_ids.sort(-1).values, ref.topk(4, dim=-1).indices.sort(-1).values)


def test_compute_logprobs_zero_top_and_raw_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    chosen, top_vals, top_ids = compute_logprobs(logits, torch.tensor([2, 1]), 0)
    assert top_vals.shape == (2, 0) and top_ids.shape == (2, 0)
    assert chosen.dtype == torch.float32
    # Raw logits: independent of any temperature the request used.
    torch.testing.assert_close(chosen[1], torch.tensor(math.log(1 / 3)))
    with pytest.raises(ValueError, match="num_top"):
        compute_logprobs(logits, torch.tensor([0, 0]), 4)


def test_directly_constructed_batch_derives_summaries() -> None:
    params = [SamplingParams(temperature=0), SamplingParams(top_p=0.8, seed=1), SamplingParams(min_p=0.5)]
    built = build(params, 4)
    assert built.rows_to_sample() == [1, 2]
    assert built.needs_sort(4) and built.needs_min_p()
    direct = SamplingBatch(
        temperature=built.temperature,
        top_k=built.top_k,
        top_p=built.top_p,
        min_p=built.min_p,
        greedy=built.greedy,
        generators=built.generators,
    )
    logits = scrambled_logits().expand(3, -1)
    assert direct.rows_to_sample() == [1, 2]
    torch.testing.assert_close(processed_probs(logits, direct), processed_probs(logits, built))


def test_positional_sample_is_exact_and_keyed_by_position() -> None:
    """Deterministic modes sample position n with noise keyed by (seed, n): the same key gives the same token,
    tokens over many positions follow the distribution (chi-square), and a greedy row's margin is its top-1
    minus top-2 logit."""
    from turbospec.sampler import positional_sample

    logits = scrambled_logits().unsqueeze(0)
    probs = torch.tensor([BASE_PROBS[PERM.index(t)] for t in range(len(PERM))]).unsqueeze(0)
    first, _ = positional_sample(logits, probs, [(7, 100)])
    assert positional_sample(logits, probs, [(7, 100)])[0] == first
    n = 4000
    tokens, margins = positional_sample(logits.expand(n, -1), probs.expand(n, -1), [(7, i) for i in range(n)])
    counts = torch.tensor([tokens.count(t) for t in range(len(PERM))], dtype=torch.float64)
    assert chi_square(counts, probs[0].double()) < 25.0, counts  # df 3: P(chi2_3 > 25) ~ 1.6e-5
    assert (margins >= 0).all()
    greedy_tokens, greedy_margin = positional_sample(logits, probs, [None])
    assert greedy_tokens == [PERM[0]]
    assert greedy_margin.item() == pytest.approx(math.log(0.5) - math.log(0.3))
