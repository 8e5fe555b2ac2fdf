"""The fused bf16 operators (kernels/fused_ops.cpp) compute the Python layers' values: the same bits for the
rotary and the residual add, a norm at most one bf16 step away."""

from __future__ import annotations

import pytest
import torch

from turbospec import LLM, SamplingParams, kernels
from turbospec.models.layers import RMSNorm, Rotary

pytestmark = pytest.mark.skipif(kernels.fused_ops() is None, reason="compiled kernels unavailable")


@pytest.fixture
def python_ops(monkeypatch):
    """Call to run the layers' Python code instead of the fused operators."""
    return lambda: monkeypatch.setattr(kernels, "_NO_FUSED", True)


def _norm(dim: int, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6)
    gen = torch.Generator().manual_seed(seed)
    norm.weight.data = (torch.rand(dim, generator=gen) + 0.5).bfloat16()
    return norm


@pytest.mark.parametrize("rows", [1, 5, 300])  # decode, a verification, a prefill chunk (parallel over rows)
def test_rms_norm_and_the_residual_add_before_it_equal_the_python_norm(rows, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    norm = _norm(1536, rows)
    x = (torch.randn(rows, 1536, generator=gen) * 4).bfloat16()
    delta = torch.randn(rows, 1536, generator=gen).bfloat16()
    fused, (fused_sum, fused_norm) = norm(x), norm.add_forward(x, delta)
    monkeypatch.setattr(kernels, "_NO_FUSED", True)
    assert torch.equal(fused_sum, x + delta)
    for got, want in ((fused, norm(x)), (fused_norm, norm(x + delta))):
        # the sum of squares is added in another order than torch's reduction: a value may round to the
        # neighbouring bf16 (1 in 2000 here), never much further
        step = 2 * torch.finfo(torch.bfloat16).eps * want.float().abs()  # x rounds, then w * x rounds again
        assert ((got.float() - want.float()).abs() <= step).all()
        assert (got != want).float().mean() < 0.005


def test_rotary_of_a_strided_view_equals_the_python_rotation(monkeypatch):
    """q and k are a view into the fused qkv projection (rows strided by q + k + v): read in place."""
    rotary = Rotary(64, 4096, 10000.0)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, 20 * 64, generator=gen).bfloat16()
    qk = qkv[:, : 18 * 64].view(-1, 18, 64)
    positions = torch.tensor([0, 1, 2, 900, 901, 4000, 4095])
    fused = rotary(qk, positions)
    assert fused.is_contiguous() and fused.shape == (7, 18, 64)
    monkeypatch.setattr(kernels, "_NO_FUSED", True)
    assert torch.equal(fused, rotary(qk, positions))


def test_inputs_the_operators_do_not_cover_take_the_python_path():
    """float32 rows, a Gemma (1 + w) norm and inputs that need gradients never reach the bf16 operators."""
    norm = _norm(64, 1)
    x = torch.randn(3, 64)
    assert torch.equal(norm.float()(x), norm.weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))
    gemma = RMSNorm(64, 1e-6, offset=1.0)
    assert gemma._fused(x.bfloat16()) is None
    grad = torch.randn(3, 64).bfloat16().requires_grad_()
    out = _norm(64, 2)(grad)
    out.float().sum().backward()  # the fused operators have no backward: this would raise
    assert grad.grad is not None


@pytest.mark.slow
def test_a_models_greedy_tokens_and_logprobs_are_the_same_with_and_without_the_fused_operators(monkeypatch):
    """A bf16 engine (prefill, then decode steps) through every layer's norms and rotary."""
    llm = LLM("smollm2-135m", dtype="bfloat16", weight_format="bf16", kv_cache_memory_gib=0.25, progress=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"

    def run() -> tuple[list[int], list]:
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, out.logprobs

    fused_tokens, fused_logprobs = run()
    monkeypatch.setattr(kernels, "_NO_FUSED", True)
    tokens, logprobs = run()
    assert fused_tokens == tokens
    # a norm's last bit may differ (test above), and 30 layers on it may move a bf16 logit by one spacing: 0.25 for
    # logits of 32 to 64. Seen: 0.25 on AMD EPYCs (Zen 2, portable loops; Zen 4, our bf16 kernel's AVX512_BF16
    # path), under 0.05 on a Xeon with AMX: which logit's rounding flips is luck, so one spacing is the bound
    tolerance = 0.3
    for fused_step, step in zip(fused_logprobs, logprobs):
        both = fused_step.keys() & step.keys()
        assert all(abs(fused_step[t].logprob - step[t].logprob) <= tolerance for t in both)
        # the top-k sets may differ only by a near tie at their cut: a token in one set alone sits within the
        # tolerance of the other set's last one
        for ours, theirs in ((fused_step, step), (step, fused_step)):
            cut = min(e.logprob for e in theirs.values())
            assert all(abs(ours[t].logprob - cut) <= tolerance for t in ours.keys() - both)
