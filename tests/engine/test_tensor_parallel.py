"""Tensor parallelism: the plan (which rank holds which KV-head groups), the grouped reduction the invariant path
uses, and real two-process engines (gloo) against one-process ones: bitwise the same tokens and log-probs in
the batch-invariant mode (plain, chunked prefill, a token tree), the same tokens and close log-probs
otherwise, speculation and the goodput controller on top, and a clean error when a rank dies."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from turbospec import LLM, SamplingParams
from turbospec.attention import build_metadata
from turbospec.cli import main
from turbospec.config import EngineConfig
from turbospec.determinism.batch_invariant import invariant_linear
from turbospec.kv.kv_cache import KVCache
from turbospec.models.layers import RowLinear, dummy_init_
from turbospec.models.loader import build_empty
from turbospec.models.model_config import DUMMY_SHAPES, ModelConfig
from turbospec.outputs import RequestOutput
from turbospec.parallel.comm import Communicator, TensorParallelError
from turbospec.parallel.plan import ShardPlan, check_tensor_parallel, group_ranges
from turbospec.parallel.shard import shard_model
from turbospec.server.async_engine import AsyncEngine
from turbospec.tuning.profiler import GRIDS, ProfileGrid, profile_key, profile_path

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


def test_many_kv_heads_merge_into_at_most_eight_reduction_slices_and_splits_keep_them_whole() -> None:
    assert _config().reduction_groups == 3
    llama2 = DUMMY_SHAPES["llama-2-7b"]  # 32 KV heads: 8 slices of 4
    assert llama2.reduction_groups == 8
    for world in (2, 4, 8):
        check_tensor_parallel(llama2, world)
    with pytest.raises(ValueError, match="cut the model's reduction slices of 4 KV heads: use one of .*8"):
        check_tensor_parallel(llama2, 3)


# --- sharded layers, two ranks in threads of this process -----------------------------------------------------

def _shard_outputs(cfg: ModelConfig, world: int, invariant: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The unsharded model's hidden states for one prompt, and every rank's (each rank a thread with its own
    gloo process group member, as in separate processes)."""
    model = build_empty(cfg, torch.float32, "cpu")
    dummy_init_(model, seed=1)
    for p in model.parameters():  # dummy_init_'s 0.02 scale would make every check trivially close
        p.data.mul_(20.0 if p.dim() > 1 else 1.0)
    ids = torch.randint(0, cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(11)

    def forward(m: torch.nn.Module, kv_cfg: ModelConfig) -> torch.Tensor:
        kv = KVCache.allocate(kv_cfg, 1, 16, torch.float32, "cpu")
        meta = build_metadata([11], [11], [torch.arange(16)], invariant=[invariant])
        return m(ids, positions, meta, kv.layers)

    full = forward(model, cfg)
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    outputs: list[torch.Tensor | None] = [None] * world

    def rank(r: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, world, is_master=False)
        comm = Communicator(client, r, world, "gloo")
        plan = ShardPlan(r, world, cfg)
        shard = copy.deepcopy(model)
        shard_model(shard, plan, comm)
        outputs[r] = forward(shard, plan.local_config())

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(o is not None for o in outputs), "a rank failed"
    return full, outputs  # type: ignore[return-value]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("invariant", [False, True])
def test_every_rank_of_a_sharded_model_computes_the_unsharded_hidden_states(arch: str, invariant: bool) -> None:
    """qkv with bias (Qwen2-like), an uneven 2 + 1 split of 3 KV heads, and Gemma3's per-head q/k norms."""
    cfg = _config(qkv_bias=arch == "llama")
    if arch == "gemma3":
        cfg = dataclasses.replace(cfg, arch="gemma3", sliding_window=8, sliding_window_pattern=2,
                                  query_pre_attn_scalar=16.0, tie_word_embeddings=True)
    full, ranks = _shard_outputs(cfg, 2, invariant)
    for out in ranks:
        if invariant:  # the same partial products, added in the same order
            assert torch.equal(out, full)
        else:
            torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    assert full.abs().max() > 1.0  # activations large enough for a wrong shard to show


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
        llm.shutdown()
    assert all(p.wait(timeout=20) is not None for p in procs)  # the other rank has exited


@pytest.fixture(scope="module")
def float32_reference() -> list[tuple[list[int], list[float]]]:
    return _run(_engine(dtype="float32"))


def _same_tokens_close_logprobs(got: list[tuple[list[int], list[float]]],
                                want: list[tuple[list[int], list[float]]]) -> None:
    """float32, so that the all-reduce's rounding stays far below any near-tie."""
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-3


@pytest.mark.slow
def test_token_trees_under_two_ranks_keep_the_plain_output(float32_reference) -> None:
    """Medusa heads draft trees (the default mode: deterministic requests verify chains only); verifying one
    moves the accepted path's K/V down on every rank (copy_slots)."""
    llm = _engine(dtype="float32", tensor_parallel_size=2,
                  speculative_config={"method": "medusa", "num_speculative_tokens": 6})
    group = llm.engine.runner.parallel
    moved = []
    real_copy = group.copy_slots
    group.copy_slots = lambda src, dst: (moved.append(bool((src != dst).any())), real_copy(src, dst))
    try:
        _same_tokens_close_logprobs(_run(llm), float32_reference)
        assert llm.engine.speculation.stats.num_accepted_tokens > 0
        assert any(moved)  # an accepted path off the first branch moved down on the other rank too
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_layer_skip_drafts_through_the_split_model(invariant_reference) -> None:
    """The self-speculative draft runs the kept layers only (layer_ids travel with the forward to every rank)."""
    llm = _engine(deterministic="batch-invariant", tensor_parallel_size=2,
                  speculative_config={"method": "layer-skip", "skip_layers": list(range(8, 22)),
                                      "num_speculative_tokens": 2})
    try:
        assert _run(llm) == invariant_reference
        assert llm.engine.speculation.stats.num_draft_tokens > 0
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_default_mode_matches_within_rounding_and_the_controller_runs_on_top(monkeypatch, float32_reference
                                                                              ) -> None:
    """The controller profiles the two-rank engine under its own key (cached apart from the one-rank profile;
    removed afterwards, as it is a deliberately short one)."""
    monkeypatch.setitem(GRIDS, "brief", ProfileGrid((1, 4), (64,), (0, 2, 4), 1))
    llm = _engine(dtype="float32", tensor_parallel_size=2, speculative_config={"method": "ngram"})
    key = profile_key(llm.engine)
    try:
        assert key["tensor_parallel"] == "2"
        assert llm.engine.speculation.controller is not None and llm.engine.speculation.controller.model.key == key
        two = _run(llm)
    finally:
        llm.shutdown()
        profile_path(key).unlink(missing_ok=True)
    _same_tokens_close_logprobs(two, float32_reference)


@pytest.mark.slow
def test_a_dead_rank_stops_the_server_engine_instead_of_hanging_it() -> None:
    """Every later step would fail: the server's engine thread fails the requests and stops, so /health (and
    Ray Serve's health check) report it and a supervisor replaces it."""
    llm = _engine(tensor_parallel_size=2)
    proc = llm.engine.runner.parallel._procs[0]
    proc.kill()
    proc.wait(timeout=20)

    async def serve_one() -> tuple[RequestOutput | Exception, bool]:
        engine = AsyncEngine(llm.engine, max_pending=4)
        engine.start()
        try:
            async for out in engine.generate("r", llm.get_tokenizer().encode(PROMPTS[0]), GREEDY):
                last: RequestOutput | Exception = out
        except Exception as exc:  # noqa: BLE001 -- what the client gets is the point
            last = exc
        await asyncio.sleep(0.2)
        alive = engine.is_alive
        await engine.stop()
        return last, alive

    started = time.monotonic()
    last, alive = asyncio.run(asyncio.wait_for(serve_one(), 60))
    assert time.monotonic() - started < 60
    assert isinstance(last, RequestOutput) and last.outputs[0].finish_reason == "error"
    assert "rank 1 exited" in last.error
    assert not alive
    with pytest.raises(TensorParallelError, match="rank 1 exited"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


@pytest.mark.slow
def test_a_forward_cut_short_on_rank_0_breaks_the_group_cleanly() -> None:
    """Rank 1 is left inside a collective of the cut forward: the next forward must not pair with it (gloo
    would abort the process, or mix two steps); it fails with TensorParallelError and the ranks are stopped."""
    llm = _engine(tensor_parallel_size=2)
    layer = llm.engine.loaded.model.layers[1]
    real = layer.forward

    def interrupted(*args: object, **kwargs: object) -> torch.Tensor:
        layer.forward = real
        raise KeyboardInterrupt  # e.g. Ctrl-C in a notebook, mid-forward

    layer.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    with pytest.raises(TensorParallelError, match="interrupted on rank 0"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert all(p.poll() is not None for p in llm.engine.runner.parallel._procs)


@pytest.mark.slow
def test_cli_refuses_more_ranks_than_kv_heads(capsys) -> None:
    assert main(["generate", "--model", MODEL, "--prompt", "hi", "--tensor-parallel-size", "4"]) == 2
    assert "tensor_parallel_size 4 exceeds the model's 3 KV heads" in capsys.readouterr().err
