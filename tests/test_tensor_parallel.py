"""Tensor parallelism: the plan (which rank holds which KV-head groups), the grouped reduction the invariant path
uses, and real two-process engines (gloo) against one-process ones: bitwise the same tokens and log-probs in
the batch-invariant mode (plain, chunked prefill, a token tree), the same tokens and close log-probs
otherwise, speculation and the goodput controller on top, and a clean error when a rank dies."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.nn.functional as F

from turbospec import LLM, SamplingParams
from turbospec.cli import main
from turbospec.config import EngineConfig
from turbospec.control.profiler import GRIDS, ProfileGrid, profile_key, profile_path
from turbospec.determinism.batch_invariant import invariant_linear
from turbospec.models.layers import RowLinear
from turbospec.models.model_config import ModelConfig
from turbospec.parallel.plan import ShardPlan, check_tensor_parallel, group_ranges

MODEL = "smollm2-135m"  # 9 query heads over 3 KV heads: two ranks hold 2 + 1 groups (an uneven split)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a poem about autumn leaves falling on a quiet river in the early morning light, with the mist rising "
    "slowly over the water and birds calling from the trees on both banks.",
]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, logprobs=1)


def _config(**changes: int) -> ModelConfig:
    base = ModelConfig(arch="llama", vocab_size=100, hidden_size=64, intermediate_size=192, num_layers=2,
                       num_heads=6, num_kv_heads=3, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                       max_position_embeddings=64)
    return dataclasses.replace(base, **changes)


# --- the plan -----------------------------------------------------------------------------------------------------

def test_groups_are_contiguous_and_even_with_the_larger_runs_first() -> None:
    assert group_ranges(3, 2) == [range(0, 2), range(2, 3)]
    assert group_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert group_ranges(2, 2) == [range(0, 1), range(1, 2)]
    assert group_ranges(3, 1) == [range(0, 3)]


def test_local_config_keeps_each_rank_own_heads_and_features() -> None:
    cfg = _config()
    first, second = (ShardPlan(r, 2, cfg).local_config() for r in (0, 1))
    assert (first.num_heads, first.num_kv_heads, first.intermediate_size) == (4, 2, 128)
    assert (second.num_heads, second.num_kv_heads, second.intermediate_size) == (2, 1, 64)
    assert first.hidden_size == second.hidden_size == cfg.hidden_size and first.vocab_size == cfg.vocab_size


def test_plans_that_cannot_work_are_refused_with_what_would() -> None:
    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads.*at most 3"):
        check_tensor_parallel(_config(), 4)
    with pytest.raises(ValueError, match="do not split into 3 KV-head groups"):
        check_tensor_parallel(_config(intermediate_size=200), 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(MODEL, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="splits dense weights.*'int4'"):
        EngineConfig(MODEL, tensor_parallel_size=2, weight_format="int4")


# --- the grouped reduction ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_row_linear_adds_its_group_slices_in_order(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    lin = RowLinear(96, 40, bias=False).to(dtype)
    lin.weight.data = (torch.randn(40, 96, generator=gen) * 0.1).to(dtype)
    lin.group_width = 32
    x = torch.randn(5, 96, generator=gen).to(dtype)
    parts = [invariant_linear(x[:, i:i + 32].contiguous(), lin.weight[:, i:i + 32].contiguous()).float()
             for i in (0, 32, 64)]
    expected = ((parts[0] + parts[1]) + parts[2]).to(dtype)
    assert torch.equal(lin(x, invariant=True), expected)
    # a slice's row stride (a shard holds a narrower weight) does not change its partial product
    shard = lin.weight[:, 32:].contiguous()
    assert torch.equal(invariant_linear(x[:, 32:].contiguous()[:, :32], shard[:, :32]).float(), parts[1])
    # the plain path is untouched by the grouping
    assert torch.equal(lin(x), F.linear(x, lin.weight))


# --- real engines ---------------------------------------------------------------------------------------------------

def _run(llm: LLM, prompts: list[str] = PROMPTS) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, [next(iter(s.values())).logprob for s in o.outputs[0].logprobs]) for o in outs]


def _engine(**options: object) -> LLM:
    return LLM(MODEL, num_threads=1, progress=False, **options)


@pytest.fixture(scope="module")
def invariant_reference() -> list[tuple[list[int], list[float]]]:
    return _run(_engine(deterministic="batch-invariant"))


@pytest.mark.slow
def test_two_ranks_give_bitwise_the_tokens_and_logprobs_of_one_in_the_invariant_mode(invariant_reference) -> None:
    llm = _engine(deterministic="batch-invariant", tensor_parallel_size=2, max_num_batched_tokens=16)
    procs = list(llm.engine.runner.parallel._procs)
    try:
        assert llm.engine.kv.layers[0][0].shape[1] == 2  # rank 0 holds 2 of the 3 KV heads
        assert _run(llm) == invariant_reference  # prompts prefilled in 16-token chunks, batched together
    finally:
        llm.engine.shutdown()
    assert all(p.wait(timeout=20) is not None for p in procs)  # the other rank has exited


@pytest.mark.slow
def test_a_token_tree_under_two_ranks_keeps_the_plain_output(invariant_reference) -> None:
    """Medusa heads draft trees; verifying one moves the accepted path's K/V on every rank (copy_slots)."""
    llm = _engine(deterministic="batch-invariant", tensor_parallel_size=2,
                  speculative_config={"method": "medusa", "num_speculative_tokens": 3})
    try:
        assert _run(llm) == invariant_reference
        stats = llm.engine.spec_stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_default_mode_matches_within_rounding_and_the_controller_runs_on_top(monkeypatch) -> None:
    """float32 so that the all-reduce's rounding stays far below any near-tie; the controller profiles the
    two-rank engine under its own key (cached apart from the one-rank profile; removed afterwards, as it is
    a deliberately short one)."""
    monkeypatch.setitem(GRIDS, "brief", ProfileGrid((1, 4), (64,), (0, 2, 4), 1))
    one = _run(_engine(dtype="float32"))
    llm = _engine(dtype="float32", tensor_parallel_size=2, speculative_config={"method": "ngram"})
    key = profile_key(llm.engine)
    try:
        assert key["tensor_parallel"] == "2"
        assert llm.engine.controller is not None and llm.engine.controller.model.key == key
        two = _run(llm)
    finally:
        llm.engine.shutdown()
        profile_path(key).unlink(missing_ok=True)
    for (tokens_1, logprobs_1), (tokens_2, logprobs_2) in zip(one, two, strict=True):
        assert tokens_1 == tokens_2
        assert max(abs(a - b) for a, b in zip(logprobs_1, logprobs_2, strict=True)) < 1e-3


@pytest.mark.slow
def test_a_dead_rank_fails_the_next_step_instead_of_hanging() -> None:
    llm = _engine(tensor_parallel_size=2)
    proc = llm.engine.runner.parallel._procs[0]
    proc.kill()
    proc.wait(timeout=20)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 60
    llm.engine.shutdown()


@pytest.mark.slow
def test_cli_refuses_more_ranks_than_kv_heads(capsys) -> None:
    assert main(["generate", "--model", MODEL, "--prompt", "hi", "--tensor-parallel-size", "4"]) == 2
    assert "tensor_parallel_size 4 exceeds the model's 3 KV heads" in capsys.readouterr().err
