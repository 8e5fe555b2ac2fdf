"""Our bf16 matmul (kernels/bf16_rows.cpp): float32 sums of bf16 products rounded once, against an exact
reference; each row's bits independent of the other rows of the call and of the thread count; used by
row_linear only where it may be (bf16, no gradients, not the batch-invariant path, within the measured rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turbospec import kernels
from turbospec.models import layers

pytestmark = pytest.mark.skipif(kernels.load() is None or not torch.ops.turbospec.bf16_rows_available(),
                                reason="compiled kernels unavailable or no AVX2 + FMA")

# the AVX2 path always; the AVX512_BF16 one (vdpbf16ps) as well where this CPU has it (widened=False takes it there)
PATHS = [True] + ([False] if kernels.bf16_rows_path() == "dpbf16" else [])


def _operands(rows: int, out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
    return x, w


@pytest.mark.parametrize("widened", PATHS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 13, 25, 30])  # every tile shape, chunks of 24 crossed
@pytest.mark.parametrize("shape", [(37, 40), (64, 576), (18, 1552)])  # outputs not in 4s, inputs not in 16s / 32s
def test_products_are_the_exact_sums_rounded_once(rows, shape, widened):
    x, w = _operands(rows, *shape, seed=rows)
    bias = torch.randn(shape[0]).bfloat16()
    got = kernels.bf16_rows_mm(x, w, bias, widened=widened)
    exact = x.double() @ w.double().t() + bias.double()
    # float32 sums in another order than the exact one: off by at most K float32 roundings of the terms'
    # magnitude, then one bf16 rounding of the result
    slack = shape[1] * 2.0 ** -23 * (x.double().abs() @ w.double().abs().t() + bias.double().abs())
    bound = torch.finfo(torch.bfloat16).eps * exact.abs() + slack
    assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
    assert ((got.double() - exact).abs() <= bound).all()
    # and it is torch's product up to those roundings (a swapped weight half or a lost tail would not be)
    assert torch.allclose(got.float(), F.linear(x, w, bias).float(), rtol=0.02, atol=1e-2)


@pytest.mark.parametrize("widened", PATHS)
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_the_threads(widened):
    x, w = _operands(30, 100, 1552, seed=7)
    alone = torch.cat([kernels.bf16_rows_mm(x[i:i + 1], w, widened=widened) for i in range(30)])
    threads = torch.get_num_threads()
    try:
        for count in {1, max(threads, 2)}:
            torch.set_num_threads(count)
            for rows in (2, 5, 9, 24, 30):
                assert torch.equal(kernels.bf16_rows_mm(x[:rows], w, widened=widened), alone[:rows])
    finally:
        torch.set_num_threads(threads)


def test_leading_dimensions_are_flattened_and_restored():
    x, w = _operands(12, 40, 64, seed=1)
    got = kernels.bf16_rows_mm(x.view(3, 4, 64), w)
    assert got.shape == (3, 4, 40) and torch.equal(got.view(12, 40), kernels.bf16_rows_mm(x, w))


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls that reach our operator (its bits often equal torch's, so equality alone cannot tell)."""
    calls = []
    real = kernels.bf16_rows_mm

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(kernels, "bf16_rows_mm", counted)
    return calls


def test_row_linear_runs_it_only_where_it_may(monkeypatch, kernel_calls):
    x, w = _operands(5, 48, 64, seed=3)
    monkeypatch.setattr(kernels, "_bf16_limits", {torch.get_num_threads(): float("inf")})
    layers.row_linear(x, w)
    assert len(kernel_calls) == 1
    # float32, a gradient to take (weight or bias), an empty input row and strided inputs stay with torch
    layers.row_linear(x.float(), w.float())
    trained = w.clone().requires_grad_(True)
    layers.row_linear(x, trained).float().sum().backward()
    assert trained.grad is not None
    assert torch.allclose(trained.grad.float(), x.float().sum(0, keepdim=True).expand_as(w), rtol=0.01, atol=0.02)
    layers.row_linear(x, w, torch.zeros(48, dtype=torch.bfloat16, requires_grad=True))
    assert layers.row_linear(x[:, :0], w[:, :0]).shape == (5, 48)
    layers.row_linear(x, w.t().contiguous().t())
    assert len(kernel_calls) == 1
    # a slice of the weight's inputs (a tensor-parallel group) is read in place: the same bits as a copy of it
    sliced = layers.row_linear(x[:, :32], w[:, :32])
    assert len(kernel_calls) == 2 and torch.equal(sliced, kernels.bf16_rows_mm(x[:, :32], w[:, :32].clone()))
    # above the measured rows, torch's product
    monkeypatch.setattr(kernels, "_bf16_limits", {torch.get_num_threads(): 4.0})
    kernel_calls.clear()
    layers.row_linear(x, w)
    assert not kernel_calls
    layers.row_linear(x[:4], w)
    assert len(kernel_calls) == 1


def test_switched_off_it_is_never_used(monkeypatch, tmp_path):
    monkeypatch.setenv("TURBOSPEC_NO_BF16_ROWS", "1")
    monkeypatch.setattr(kernels, "_bf16_limits", {})
    assert kernels.bf16_rows_limit() == 0
    x, w = _operands(3, 16, 32, seed=2)
    assert torch.equal(layers.row_linear(x, w), F.linear(x, w))


def test_the_measured_limit_is_cached_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("TURBOSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_bf16_limits", {})
    monkeypatch.setattr(kernels, "BF16_PROBE_SHAPES", ((64, 128),))
    monkeypatch.setattr(kernels, "BF16_PROBE_ROWS", (1, 2, 4))
    monkeypatch.setattr("turbospec.host.STREAM_POOL_BYTES", 1 << 20)  # 64 copies streamed, not the 96 MB a machine gets
    limit = kernels.bf16_rows_limit()
    files = list((tmp_path / "kernels").glob("bf16-rows-*.json"))
    assert len(files) == 1 and limit in (0, 1, 2, 4, float("inf"))
    monkeypatch.setattr(kernels, "_bf16_limits", {})
    monkeypatch.setattr("turbospec.kernels.best_ms", lambda *a, **k: pytest.fail("measured again"))
    assert kernels.bf16_rows_limit() == limit  # a new process reads the file and measures nothing


def test_the_batch_invariant_mode_takes_it_by_the_cpu_not_by_a_timing(monkeypatch, kernel_calls):
    """Every call of the mode on AVX2 CPUs, whatever the measured limit (a timing, per thread count: tensor-parallel
    ranks must choose alike); nowhere else."""
    from turbospec.determinism.batch_invariant import invariant_linear

    x, w = _operands(7, 48, 64, seed=4)
    monkeypatch.setattr(kernels, "_invariant_cpu", True)
    monkeypatch.setattr(kernels, "_bf16_limits", {torch.get_num_threads(): 2.0})
    got = invariant_linear(x, w)
    assert len(kernel_calls) == 1 and torch.equal(got, kernels.bf16_rows_mm(x, w))
    assert torch.equal(layers.row_linear(x, w, invariant=True), got)
    monkeypatch.setattr(kernels, "_invariant_cpu", False)
    monkeypatch.setattr(kernels, "_bf16_limits", {torch.get_num_threads(): float("inf")})
    kernel_calls.clear()
    assert invariant_linear(x, w).shape == (7, 48) and not kernel_calls
    # the choice follows the CPU: this one's best vector unit
    monkeypatch.setattr(kernels, "_invariant_cpu", None)
    assert kernels._invariant_choice() == (torch.backends.cpu.get_cpu_capability() == "AVX2")


def test_where_it_cannot_run_no_call_reaches_it(monkeypatch):
    monkeypatch.setattr(kernels, "_bf16_limits", {torch.get_num_threads(): 0.0})
    x, w = _operands(3, 16, 32, seed=5)
    assert not kernels.bf16_rows_fits(x[:0], w) and not kernels.bf16_rows_fits(x, w)
    assert layers.row_linear(x[:0], w).shape == (0, 16)


def test_the_limit_probe_streams_its_weights_at_verification_sizes(monkeypatch, tmp_path):
    """Up to BF16_STREAMED_ROWS rows each timed call reads copies of the weight adding up to host.STREAM_POOL_BYTES (a
    model's weights come from memory; one small probe weight stays in cache, where torch's product is at its best
    and stopped ours at 8 rows on a Zen 4); prefill sizes time one copy."""
    monkeypatch.setenv("TURBOSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_bf16_limits", {})
    monkeypatch.setattr(kernels, "BF16_PROBE_SHAPES", ((64, 128),))
    monkeypatch.setattr(kernels, "BF16_PROBE_ROWS", (1, 2, 64))
    monkeypatch.setattr(kernels, "BF16_STREAMED_ROWS", 2)
    monkeypatch.setattr("turbospec.host.STREAM_POOL_BYTES", 4 * 64 * 128 * 2)  # four copies of the bf16 weight
    weights: dict[int, set[int]] = {}
    real = kernels.bf16_rows_mm

    def counted(x, w, *args, **kwargs):
        weights.setdefault(x.shape[0], set()).add(w.data_ptr())
        return real(x, w, *args, **kwargs)

    def ours_wins(fns, repeats):
        for fn in fns:
            fn()
        return [0.0, 1.0]

    monkeypatch.setattr(kernels, "bf16_rows_mm", counted)
    monkeypatch.setattr("turbospec.kernels.best_ms", ours_wins)
    assert kernels.bf16_rows_limit() == float("inf")
    assert {rows: len(ptrs) for rows, ptrs in weights.items()} == {1: 4, 2: 4, 64: 1}
