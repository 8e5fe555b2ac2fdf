"""Packed weight formats: GGUF blocks taken apart exactly, packed kernels against their dequantised reference,
per-call kernel choice, and the formats on a real model (greedy output and refusals)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from turbospec import LLM, SamplingParams, kernels
from turbospec.config import EngineConfig
from turbospec.models import gguf_blocks
from turbospec.models.crossover import GEMM_ROWS, ROWS, CrossoverCache, crossover_rows, gemm_crossover
from turbospec.models.layers import RowLinear
from turbospec.models.loader import load_model
from turbospec.models.packed import PackedWeight, pack
from turbospec.models.weight_format import WeightFormatError

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q8_0": 34, "Q5_0": 22, "Q6_K": 210}
BLOCK_VALUES = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q8_0": 32, "Q5_0": 32, "Q6_K": 256}
# where each block type keeps its float16 scale(s): random bytes there could spell inf or NaN
F16_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random but valid raw blocks: every bit pattern is a legal block once its float16 scales are finite."""
    rng = np.random.default_rng(seed)
    n = rows * cols // BLOCK_VALUES[type_name]
    blocks = rng.integers(0, 256, size=(n, BLOCK_BYTES[type_name]), dtype=np.uint8)
    for off in F16_OFFSETS[type_name]:
        scale = rng.uniform(-0.05, 0.05, n).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(n, 2)
    return blocks


@pytest.mark.parametrize("type_name", list(BLOCK_BYTES))
def test_blocks_decode_to_exactly_ggufs_own_dequantisation(type_name):
    rows, cols = 6, 512
    raw = random_blocks(type_name, rows, cols)
    groups = gguf_blocks.decode(raw, type_name, rows, cols)
    reference = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, cols)
    assert np.array_equal(groups.dequantize(), reference)  # bit for bit, not close
    kind = gguf_blocks.Int4Groups if type_name in gguf_blocks.INT4_TYPES else gguf_blocks.Int8Groups
    assert isinstance(groups, kind)
    if kind is gguf_blocks.Int4Groups:
        assert groups.q.min() >= 0 and groups.q.max() <= 15


def test_types_without_an_exact_packed_form_are_not_decoded():
    assert gguf_blocks.decode(np.zeros(24 * 4, np.uint8), "Q5_1", 4, 32) is None
    assert not gguf_blocks.decodable("F16")


def _dense_reference(groups: list) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([g.dequantize() for g in groups]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("types", [("Q4_K",), ("Q4_1", "Q4_0"), ("Q6_K",), ("Q4_K", "Q4_K", "Q6_K"), ("Q8_0",),
                                   ("Q5_0", "Q8_0")])
def test_packed_linear_matches_its_dequantised_reference(types, dtype):
    cols = 512
    groups = [gguf_blocks.decode(random_blocks(t, 48, cols, seed=i), t, 48, cols) for i, t in enumerate(types)]
    packed = pack(groups, dtype)
    merged = sum(1 for a, b in zip(types, types[1:]) if (a in gguf_blocks.INT4_TYPES) == (b in gguf_blocks.INT4_TYPES))
    assert len(packed.parts) == len(types) - merged  # same-kind neighbours (q|k, gate|up) share one kernel call
    exact = _dense_reference(groups)  # the file's values, float32
    bias = torch.randn(exact.shape[0])
    for rows in (1, 3, 9):
        x = torch.randn(rows, cols).to(dtype)
        got = packed.mm(x, bias).float()
        want = x.float() @ exact.t() + bias
        # bf16: activations, outputs and the int4 group scales are rounded; float32 only the sums' order
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got - want).abs().max().item() <= (1e-4 if dtype == torch.float32 else 3e-2) * want.abs().max().item()


def _amx_part(groups):
    """The AMX part `pack` would choose: int4, int6 where the values fit six bits, else int8."""
    from turbospec.models.packed import AmxInt4Part, AmxInt6Part, AmxInt8Part

    if isinstance(groups, gguf_blocks.Int4Groups):
        return AmxInt4Part.from_groups(groups)
    return (AmxInt6Part if AmxInt6Part.fits(groups) else AmxInt8Part).from_groups(groups)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q4_0", "Q4_1", "Q6_K", "Q8_0", "Q5_0"])
def test_amx_layout_holds_the_files_values(type_name):
    """The AMX parts' tile order and per-block float16 scales are a re-layout, not a re-quantisation: exact where
    the file's scales are float16, the K-quants' d * sc rounded to float16 (runs on any CPU)."""
    groups = gguf_blocks.decode(random_blocks(type_name, 48, 512), type_name, 48, 512)
    part = _amx_part(groups)
    exact = torch.from_numpy(groups.dequantize())
    assert part.nbytes == exact.numel() * {"Q8_0": 1.125, "Q6_K": 0.875, "Q5_0": 0.875}.get(type_name, 0.625)
    if type_name in ("Q4_K", "Q6_K"):
        assert not torch.equal(part.dequantize(), exact)  # (the check below would pass a no-op rounding too)
        assert torch.allclose(part.dequantize(), exact, rtol=0, atol=2**-10 * exact.abs().max().item())
    else:
        assert torch.equal(part.dequantize(), exact)


def _record_paths() -> list:
    """The kernels that run the tile-order records on this CPU, each a test case; the others skip with the reason."""
    available = {"amx": kernels.amx_available(), "dpbf16": kernels.dpbf16_records_available(),
                 "avx2": kernels.avx2_records_available()}
    why = {"amx": "this CPU has no AMX", "dpbf16": "this CPU has no AVX512-BF16 (or TURBOSPEC_NO_DPBF16 is set)",
           "avx2": "this CPU has no AVX2 + FMA + F16C"}
    return [pytest.param(path, marks=pytest.mark.skipif(not ok, reason=f"{why[path]} (the layout test above runs "
                                                        "anyway)")) for path, ok in available.items()]


@pytest.mark.parametrize("path", _record_paths())
@pytest.mark.parametrize("type_name", ["Q4_K", "Q4_0", "Q4_1", "Q6_K", "Q5_0", "Q8_0"])
def test_record_kernels_match_the_dequantised_reference_for_every_row_count(type_name, path):
    n, k = 80, 1024  # 5 blocks of 16 outputs: runs of several blocks and single blocks per thread share the work
    groups = gguf_blocks.decode(random_blocks(type_name, n, k), type_name, n, k)
    part = _amx_part(groups)
    kind = {"Q4_K": "amx-int4", "Q4_0": "amx-int4", "Q4_1": "amx-int4", "Q6_K": "amx-int6", "Q5_0": "amx-int6",
            "Q8_0": "amx-int8"}[type_name]
    assert part.kind == kind
    op = getattr(torch.ops.turbospec, kind.replace("amx", path).replace("-", "_") + "_mm")
    exact = torch.from_numpy(groups.dequantize())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, k, generator=gen).bfloat16()
    want = x.float() @ exact.t()
    assert op(x[:0], part.data).shape == (0, n)  # an empty call (no rows) is valid
    alone = torch.cat([op(x[i:i + 1], part.data) for i in range(40)])
    for rows in [*range(1, 18), 33, 40]:  # every register-blocked count, then whole and partial row blocks
        got = op(x[:rows], part.data)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        # only the output's bf16 rounding and the order of float32 sums differ
        err = (got.float() - want[:rows]).abs().max().item()
        assert err <= 8e-3 * want[:rows].abs().max().item(), (rows, err)
        if path != "amx":  # each row summed in the same order whatever shares the call: a verification row's
            assert torch.equal(got, alone[:rows]), rows  # bits are its decode step's
    # AMX: int6's two-row calls (a draft model's catch-up) run the one-row vector path per row
    if type_name == "Q6_K":
        pair = op(torch.stack([x[7], x[3]]), part.data)
        assert torch.equal(pair[0], alone[7]) and torch.equal(pair[1], alone[3])


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x with each row's groups of 32 quantised to int8 as our auto-q8act kernel does (scale max|x| / 127, round to
    nearest even), dequantised again: the activations that kernel multiplies exactly."""
    groups = x.float().reshape(x.shape[0], -1, 32)
    top = groups.abs().amax(-1, keepdim=True)
    scale = torch.where(top > 0, top / 127, torch.ones_like(top))
    return (torch.round(groups * (1 / scale)).clamp(-127, 127) * scale).reshape(x.shape)


def _int8_activation_paths() -> dict[str, bool]:
    """Which int8-activation kernels of the records run here: AVX512-VNNI's ("q8") and AVX2's ("avx2q8")."""
    module = kernels.load()
    return {"q8": module is not None and bool(module.q8_records_available()),
            "avx2q8": module is not None and bool(module.avx2_records_available())}


def _int8_activation_kernels() -> list:
    """Those kernels, each a test case; the ones this CPU lacks skip with the reason."""
    why = {"q8": "this CPU has no AVX512-VNNI", "avx2q8": "this CPU has no AVX2 + FMA + F16C"}
    return [pytest.param(path, marks=pytest.mark.skipif(not ok, reason=why[path]))
            for path, ok in _int8_activation_paths().items()]


@pytest.mark.parametrize("path", _int8_activation_kernels())
@pytest.mark.parametrize("type_name", ["Q4_K", "Q4_0", "Q4_1", "Q6_K", "Q5_0", "Q8_0"])
def test_the_int8_activation_kernel_is_the_exact_product_of_quantised_activations(type_name, path):
    n, k = 80, 1024
    groups = gguf_blocks.decode(random_blocks(type_name, n, k), type_name, n, k)
    part = _amx_part(groups)
    op = getattr(torch.ops.turbospec, part.kind.replace("amx", path).replace("-", "_") + "_mm")
    weights = part.dequantize()  # the records' values (K-quant scales in float16)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    x[3, :32] = 0  # an all-zero group
    want = _int8_activations(x) @ weights.t()
    exact = x.float() @ weights.t()
    alone = torch.cat([op(x[i:i + 1], part.data) for i in range(40)])
    for rows in [*range(1, 18), 33, 40]:
        got = op(x[:rows], part.data)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        err = (got.float() - want[:rows]).abs().max().item()
        assert err <= 8e-3 * want[:rows].abs().max().item(), (rows, err)  # bf16 output, float32 sums' order
        assert torch.equal(got, alone[:rows]), rows
    lossy = (want - exact).abs().max().item()
    assert 0 < lossy <= 3e-2 * exact.abs().max().item()  # a lossy step of its own, and a small one


def test_a_forced_record_path_the_cpu_lacks_is_refused_by_the_operator():
    """Each path's operator refuses to run where its CPU feature is missing (rather than faulting)."""
    groups = gguf_blocks.decode(random_blocks("Q4_0", 16, 64), "Q4_0", 16, 64)
    data = _amx_part(groups).data
    for path, ok in (("amx", kernels.amx_available()), ("dpbf16", kernels.dpbf16_records_available())):
        op = getattr(torch.ops.turbospec, f"{path}_int4_mm")
        if ok:
            assert op(torch.ones(1, 64).bfloat16(), data).shape == (1, 16)
        else:
            with pytest.raises(RuntimeError, match="does not offer"):
                op(torch.ones(1, 64).bfloat16(), data)


def test_packed_parts_survive_the_cache_round_trip(tmp_path):
    from safetensors.torch import load_file, save_file

    from turbospec.models.packed import load_parts, save_parts

    groups = [gguf_blocks.decode(random_blocks(t, 16, 256, seed=i), t, 16, 256) for i, t in enumerate(("Q4_K", "Q6_K"))]
    packed = pack(groups, torch.bfloat16)
    tensors: dict[str, torch.Tensor] = {}
    kinds = save_parts(packed, "layers.0.mlp.down.weight", tensors)
    save_file(tensors, str(tmp_path / "p.safetensors"))
    again = load_parts(kinds, "layers.0.mlp.down.weight", load_file(str(tmp_path / "p.safetensors")), torch.bfloat16)
    x = torch.randn(2, 256).bfloat16()
    assert again.signature == packed.signature and torch.equal(again.mm(x), packed.mm(x))


def test_compiled_int8_kernel_and_fallback_agree():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (40, 96), dtype=torch.int8, generator=gen)
    s = torch.rand(40, 6, generator=gen)
    x = torch.randn(5, 96, generator=gen)
    want = kernels.grouped_int8_mm_reference(x, q, s)
    module = kernels.load()
    if module is None:  # a machine without a compiler: the fallback is the reference itself
        pytest.skip(f"compiled kernel unavailable here: {kernels.failure()}")
    for rows in range(1, 6):  # 1..4 and a remainder block
        got = module.grouped_int8_mm(x[:rows], q, s)
        assert torch.allclose(got, want[:rows], rtol=1e-5, atol=1e-4)
    # 7 groups: fewer than four rows take groups in turn on several accumulators, with a remainder left over
    q7 = torch.randint(-128, 128, (40, 112), dtype=torch.int8, generator=gen)
    s7, x7 = torch.rand(40, 7, generator=gen), torch.randn(3, 112, generator=gen)
    want7 = kernels.grouped_int8_mm_reference(x7, q7, s7)
    for rows in range(1, 4):
        assert torch.allclose(module.grouped_int8_mm(x7[:rows], q7, s7), want7[:rows], rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        module.grouped_int8_mm(torch.randn(1, 90), q[:, :90].contiguous(), s[:, :5].contiguous())
    # a registered torch operator: the profiler names it (a pybind function would be invisible there)
    with torch.profiler.profile() as prof:
        kernels.grouped_int8_mm(x, q, s)
    assert "turbospec::grouped_int8_mm" in {e.name for e in prof.events()}


def test_rowlinear_runs_packed_up_to_the_crossover_then_dense(monkeypatch):
    groups = [gguf_blocks.decode(random_blocks("Q4_K", 32, 256), "Q4_K", 32, 256)]
    packed = pack(groups, torch.float32)
    dense = _dense_reference(groups)
    packed.max_rows = 2
    linear = RowLinear(256, 32, bias=False)
    linear.weight.data.copy_(dense)
    linear.packed = packed
    calls = []
    monkeypatch.setattr(packed, "mm", lambda x, bias=None: calls.append(x.shape[0]) or torch.zeros(x.shape[0], 32))
    linear(torch.randn(1, 256))
    linear(torch.randn(2, 256))
    linear(torch.randn(3, 256))  # above the crossover: dense
    linear(torch.randn(1, 256), invariant=True)  # batch-invariant mode: dense kernels only
    linear(torch.randn(1, 256).double())  # another dtype than the packed scales (LayerCast): dense
    assert calls == [1, 2]
    linear.weight = None  # packed only (int4 / int8): every call runs packed
    linear(torch.randn(7, 256))
    assert calls == [1, 2, 7]


def test_crossover_is_the_last_row_count_of_an_unbroken_win():
    assert crossover_rows({1: (1.0, 2.0), 2: (1.5, 2.0), 4: (2.5, 2.0), 8: (1.0, 2.0)}) == 2
    assert crossover_rows({1: (3.0, 2.0), 2: (1.0, 2.0)}) == 0  # losing at one row: never packed


def test_prefill_sizes_run_packed_from_where_packed_won_at_every_larger_one():
    win, lose = (1.0, 2.0), (3.0, 2.0)
    assert GEMM_ROWS == (48, 64, 128, 256)
    prefill = {48: win, 64: win, 128: win, 256: win}
    assert gemm_crossover(prefill, 12) == 48
    assert gemm_crossover({**prefill, 48: lose}, 12) == 64
    assert gemm_crossover({128: lose, 256: win}, 12) == 256  # measured largest first: stopped at the loss
    assert gemm_crossover({256: lose}, 12) == 0
    assert gemm_crossover({1: win, 32: win}, 32) == 0  # never measured at prefill sizes
    # packed won at every decode count (crossover_rows says the last one) and every prefill size: no dense gap
    decode = {r: win for r in ROWS}
    assert gemm_crossover({**decode, **prefill}, crossover_rows(decode)) == ROWS[-1] + 1
    assert gemm_crossover({**decode, **prefill}, crossover_rows({**decode, 32: lose})) == 48
    assert gemm_crossover({**decode, **prefill, 48: lose}, ROWS[-1]) == 64
    packed = PackedWeight([], max_rows=12, gemm_rows=64)
    assert [r for r in (1, 12, 13, 63, 64, 500) if packed.runs_packed(r)] == [1, 12, 64, 500]
    assert not PackedWeight([], max_rows=12).runs_packed(500)


def test_a_packed_weights_clone_holds_its_own_copy_of_the_same_values():
    groups = [gguf_blocks.decode(random_blocks(t, 16, 256, seed=i), t, 16, 256) for i, t in enumerate(("Q4_K", "Q6_K"))]
    packed = pack(groups, torch.bfloat16)
    packed.max_rows, packed.gemm_rows = 12, 64
    twin = packed.clone()
    x = torch.randn(3, 256).bfloat16()
    assert twin.signature == packed.signature and (twin.max_rows, twin.gemm_rows) == (12, 64)
    assert torch.equal(twin.mm(x), packed.mm(x))
    for a, b in zip(packed.parts, twin.parts):
        for name, t in a.tensors().items():
            assert b.tensors()[name].data_ptr() != t.data_ptr()


def test_crossover_timings_read_decode_sizes_from_memory_and_compare_a_call_with_a_call(monkeypatch):
    """Up to ROWS[-1] rows each side is timed over copies of its weight adding up to host.STREAM_POOL_BYTES, as a
    model's step reads its weights (timed alone, qwen2.5-coder-0.5b's Q5_0 gate|up stayed in the Zen 4's cache,
    lost to bf16 there and ran bf16 in every decode step at twice the packed cost); prefill sizes time one copy.
    The packed pool holds more copies (its weight is smaller): the comparison is per call, not per pool."""
    from turbospec.models import crossover

    groups = [gguf_blocks.decode(random_blocks("Q4_K", 32, 256), "Q4_K", 32, 256)]
    packed, dense = pack(groups, torch.bfloat16), _dense_reference(groups).bfloat16()
    monkeypatch.setattr("turbospec.host.STREAM_POOL_BYTES", 4 * dense.nbytes)  # 4 dense copies, more packed ones
    seen: dict[str, set[int]] = {"packed": set(), "dense": set()}
    calls = {"packed": 0, "dense": 0}
    real_mm = PackedWeight.mm

    def packed_mm(self, x, bias=None):
        seen["packed"].add(next(iter(self.parts[0].tensors().values())).data_ptr())
        calls["packed"] += 1
        return real_mm(self, x, bias)

    def dense_mm(x, w):
        seen["dense"].add(w.data_ptr())
        calls["dense"] += 1
        return x @ w.T

    def packed_a_call_faster(fns, repeats):  # a packed call takes 1 ms, a dense one 2 ms: pools sum their calls
        calls.update(packed=0, dense=0)
        fns[0]()
        fns[1]()
        return [1.0 * calls["packed"], 2.0 * calls["dense"]]

    monkeypatch.setattr(PackedWeight, "mm", packed_mm)
    monkeypatch.setattr(crossover, "row_linear", dense_mm)
    monkeypatch.setattr(crossover, "best_ms", packed_a_call_faster)
    timings = crossover.measure(packed, dense)
    assert len(seen["dense"]) == 4 and len(seen["packed"]) > 4  # the packed weight is a fraction of the dense one
    assert crossover_rows(timings) == ROWS[-1] and all(t == (1.0, 2.0) for t in timings.values())
    seen = {"packed": set(), "dense": set()}
    crossover.measure(packed, dense, GEMM_ROWS, repeats=1)
    assert len(seen["dense"]) == 1 and len(seen["packed"]) == 1
    # a call so slow that a pass of POOL_PASS_S holds two of them (compute-bound): two copies, not the whole pool
    slow_ms = crossover.POOL_PASS_S * 1e3 / 2

    def slow_calls(fns, repeats):
        calls.update(packed=0, dense=0)
        fns[0]()
        fns[1]()
        return [slow_ms * calls["packed"], 2 * slow_ms * calls["dense"]]

    monkeypatch.setattr(crossover, "best_ms", slow_calls)
    seen = {"packed": set(), "dense": set()}
    crossover.measure(packed, dense, (1,))
    assert len(seen["packed"]) == 2 and len(seen["dense"]) == 1


def test_two_processes_saving_crossovers_keep_each_others_entries(tmp_path):
    """Each process reads the file when it loads a model and measures its own signatures; the later save must
    not drop what the other measured meanwhile (two pytest workers, two replicas)."""
    path = tmp_path / "crossover.json"
    path.write_text(json.dumps({"a": {"rows": 1}}))  # an entry from an older format: both re-measure it
    first, second = CrossoverCache(path), CrossoverCache(path)  # both opened before either saved
    first.data["a"] = {"rows": 4, "packed_from": 0, "ms": {}}
    first.measured.add("a")
    second.data["b"] = {"rows": 6, "packed_from": 0, "ms": {}}
    second.measured.add("b")
    first.save()
    second.save()  # its stale copy of "a" must not overwrite what the first measured
    assert CrossoverCache(path).data == {"a": {"rows": 4, "packed_from": 0, "ms": {}},
                                         "b": {"rows": 6, "packed_from": 0, "ms": {}}}


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
@pytest.mark.parametrize("amx", [True, False], ids=["amx-layout", "int8-or-int4"])
def test_a_packed_weights_rows_are_cut_without_changing_a_value(type_name, amx):
    """A draft vocabulary's head (proposers/draft_vocab.py) is the LM head's rows, repacked: the same values."""
    groups = gguf_blocks.decode(random_blocks(type_name, 64, 256), type_name, 64, 256)
    rows = np.array([0, 3, 17, 18, 40, 41, 42, 43, 50, 51, 52, 53, 60, 61, 62, 63])
    if amx:
        packed = PackedWeight([_amx_part(groups)])
    else:
        packed = pack([groups], torch.float32)  # (no AMX parts in float32)
    cut = packed.take_rows(rows)
    if not amx and type_name == "Q4_K":
        assert cut is None  # torch's int4 layout is opaque: the caller keeps dense rows
        return
    assert cut is not None and cut.parts[0].kind == packed.parts[0].kind
    assert torch.equal(cut.parts[0].dequantize(), packed.parts[0].dequantize()[torch.from_numpy(rows)])
    if amx:
        assert packed.take_rows(rows[:15]) is None  # an AMX record holds 16 output rows


def test_requantizing_rounds_each_group_of_32_to_its_nearest_of_16_levels():
    gen = np.random.default_rng(3)
    q = gen.integers(-16, 16, (32, 64)).astype(np.int8)
    q[0, :32] = 5  # a constant group: held exactly
    groups = gguf_blocks.Int8Groups(q, gen.random((32, 4)).astype(np.float32) + 0.1)
    four = gguf_blocks.requantize_int4(groups)
    assert four.q.max() <= 15 and four.scale.shape == four.offset.shape == (32, 2)
    values, rounded = groups.dequantize(), four.dequantize()
    step = np.repeat(four.scale, 32, axis=1)
    assert (np.abs(rounded - values) <= step / 2 + 1e-6).all()  # nearest level, never further
    assert np.array_equal(rounded[0, :32], values[0, :32])
    per_group = values.reshape(32, 2, 32)
    assert np.allclose(four.offset, per_group.min(-1)) and np.allclose(four.scale, np.ptp(per_group, -1) / 15)


@pytest.mark.slow
def test_a_requantized_model_holds_only_4_bit_parts_and_says_so():
    exact = load_model("smollm2-135m", "float32", weight_format="int4", progress=False).weights
    four = load_model("smollm2-135m", "float32", weight_format="int4", requantize=True, progress=False).weights
    # the Q8_0 head is int8, unless its packed kernel timed slower than dense at every row count here (it is then
    # kept dense: seen on an AMD EPYC, where our int8 kernel runs its portable loop and the timing is close)
    head_packed = "lm_head.weight" not in exact.kept_dense
    assert exact.part_kinds["int8"] == int(head_packed) and set(four.part_kinds) == {"int4"}
    # fewer bytes only where the head (the file's one Q8_0 tensor) was packed and so had something to round
    assert four.packed_bytes < exact.packed_bytes if head_packed else four.packed_bytes <= exact.packed_bytes
    assert "(requantised to 4 bits)" in four.line() and "requantised" not in exact.line()


def test_requantizing_is_refused_where_it_cannot_pack():
    with pytest.raises(WeightFormatError, match="requantising to 4 bits needs a GGUF model .dummy:tiny is not one."):
        load_model("dummy:tiny", "bfloat16", weight_format="auto", requantize=True, progress=False)
    for fmt in ("bf16", "int8"):
        with pytest.raises(WeightFormatError, match=f"weight format auto or int4 .not {fmt}."):
            load_model("smollm2-135m", "bfloat16", weight_format=fmt, requantize=True, progress=False)


@pytest.mark.slow
def test_formats_on_smollm2_give_plain_decodings_greedy_output():
    """Float32: the packed kernels and the dense copy compute the same model as the bf16 format's weights."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    outputs, reports = {}, {}
    for fmt in ("bf16", "auto", "int4"):
        llm = LLM("smollm2-135m", dtype="float32", weight_format=fmt, kv_cache_memory_gib=0.25, progress=False)
        outputs[fmt] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        reports[fmt] = llm.engine.loaded.weights
        del llm
    assert outputs["auto"] == outputs["bf16"] and outputs["int4"] == outputs["bf16"]
    assert reports["bf16"].packed_linears == 0
    # every layer's 4 linears and the (tied) LM head, the Q8_0 embedding in int8, unless the load timed our int8
    # kernel slower than the dense head at every row count: on AVX2 CPUs (its portable loop) that is close at one
    # row in float32 and went either way between loads on one machine (2026-12-02: 8.6 vs 9.5 ms, then 17.4 vs 11.2)
    head_packed = "lm_head.weight" not in reports["int4"].kept_dense
    assert reports["int4"].packed_linears == 30 * 4 + head_packed
    assert reports["int4"].part_kinds["int8"] == int(head_packed)
    assert reports["int4"].dense_bytes < reports["auto"].dense_bytes / 2  # no dense copies of the layers


@pytest.mark.slow
def test_packed_logits_match_the_bf16_formats_in_bfloat16():
    """bf16 activations: one decode step's logits through the packed kernels are the dense ones up to rounding."""
    loaded = {fmt: load_model("smollm2-135m", "bfloat16", weight_format=fmt, progress=False)
              for fmt in ("bf16", "int4")}
    ids = torch.tensor([1, 504, 3120, 28, 253])
    logits = {}
    for fmt, lm in loaded.items():
        hidden = lm.model.embed(ids)[-1:]  # one row: the packed path in every linear
        logits[fmt] = lm.model.compute_logits(lm.model.norm(hidden)).float()
    diff = (logits["int4"] - logits["bf16"]).abs().max().item()
    assert diff <= 0.05 * logits["bf16"].abs().max().item()


@pytest.mark.skipif(not all(_int8_activation_paths().values()),
                    reason="needs both AVX512-VNNI and AVX2 (the AVX2 kernel is compared with the VNNI one)")
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0"])
def test_the_avx2_int8_activation_kernel_gives_the_vnni_kernels_bits(type_name):
    """The AVX2 int8-activation path computes what auto-q8act computes on an AVX-512 CPU, to the bit: the same int8 activations, exact
    integer sums, the same float32 operations in the same order."""
    n, k = 32, 8960  # a long row (a 1.5B model's down projection)
    blocks = random_blocks(type_name, n, k, seed=3)
    part = _amx_part(gguf_blocks.decode(blocks, type_name, n, k))
    name = part.kind.removeprefix("amx-")
    vnni, avx2 = (getattr(torch.ops.turbospec, f"{path}_{name}_mm") for path in ("q8", "avx2q8"))
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    x[:, ::7] *= 40  # groups whose largest value quantises to +-127 next to small ones
    x[2, 64:96] = 0
    for rows in (1, 4, 5, 9):
        assert torch.equal(avx2(x[:rows], part.data), vnni(x[:rows], part.data)), rows


@pytest.mark.skipif(not (kernels.q8_records_available() and kernels.records_path()),
                    reason="auto-q8act needs AVX512-VNNI and the record kernels")
def test_int8_activations_are_a_named_lossy_format_close_to_auto():
    """auto-q8act: every packed linear runs the int8-activation kernel (said in the load log and the crossover's
    signatures), and one decode step's logits stay close to auto's (the activations' rounding only)."""
    loaded = {fmt: load_model("smollm2-135m", "bfloat16", weight_format=fmt, progress=False)
              for fmt in ("auto", "auto-q8act")}
    report = loaded["auto-q8act"].weights
    auto = loaded["auto"].weights
    # the same linears packed, less those whose measured crossover (per kernel: timing) keeps them dense
    assert report.format == "auto-q8act"
    assert report.packed_linears + report.dense_only_linears == auto.packed_linears + auto.dense_only_linears
    assert all("-q8act:" in signature for signature in report.crossover)
    ids = torch.tensor([1, 504, 3120, 28, 253])
    logits = {}
    for fmt, lm in loaded.items():
        hidden = lm.model.embed(ids)[-1:]
        for layer in lm.model.layers[:4]:  # one row through packed linears (their crossover keeps 1 row packed)
            hidden = layer.mlp(hidden)
        logits[fmt] = lm.model.compute_logits(lm.model.norm(hidden)).float()
    diff = (logits["auto-q8act"] - logits["auto"]).abs().max().item()
    assert 0 < diff <= 0.05 * logits["auto"].abs().max().item()
    with pytest.raises(WeightFormatError, match="auto-q8act needs dtype bfloat16"):
        load_model("smollm2-135m", "float32", weight_format="auto-q8act", progress=False)


@pytest.mark.slow
def test_formats_the_file_cannot_provide_are_refused():
    with pytest.raises(WeightFormatError, match=r"int8 needs every linear in Q8_0 / Q6_K.*Q4_1"):
        load_model("smollm2-135m", "bfloat16", weight_format="int8", progress=False)
    with pytest.raises(WeightFormatError, match="not a GGUF"):
        load_model("dummy:tiny", "float32", weight_format="int4", progress=False)
    with pytest.raises(WeightFormatError, match="float16"):
        load_model("smollm2-135m", "float16", weight_format="int4", progress=False)
    dummy = load_model("dummy:tiny", "float32", weight_format="auto", progress=False)
    assert dummy.weights.packed_linears == 0  # auto on a dense source: dense, no error


def test_engine_config_validates_the_weight_format():
    with pytest.raises(ValueError, match="auto, bf16, int4, int8, auto-q8act"):
        EngineConfig("dummy:tiny", weight_format="q3_k")
    with pytest.raises(ValueError, match="keeps no dense weights"):
        EngineConfig("dummy:tiny", weight_format="int4", deterministic="batch-invariant")


@pytest.mark.slow
def test_cli_refuses_an_impossible_format_with_exit_code_2():
    done = subprocess.run([sys.executable, "-m", "turbospec.cli", "generate", "--model", "smollm2-135m",
                           "--prompt", "hi", "--weight-format", "int8"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "Q4_1" in done.stderr and "auto" in done.stderr


@pytest.mark.slow
def test_step_time_profiles_are_per_weight_format():
    """A packed engine's step times have another shape: it must never reuse a dense engine's cached profile."""
    from turbospec.tuning import build_engine
    from turbospec.tuning.profiler import profile_key

    keys = {}
    for fmt in ("bf16", "auto"):
        engine = build_engine(EngineConfig("smollm2-135m", weight_format=fmt, kv_cache_memory_gib=0.25), progress=False)
        keys[fmt] = profile_key(engine)
        del engine
    assert "weights" not in keys["bf16"]  # dense models keep their old cache keys
    assert keys["auto"]["weights"].startswith("auto:") and "int4:" in keys["auto"]["weights"]


def test_int4_packing_refuses_rows_torch_cannot_pack():
    groups = [gguf_blocks.decode(random_blocks("Q4_K", 8, 256), "Q4_K", 8, 256)]
    with pytest.raises(ValueError, match="multiples of 16"):
        pack(groups, torch.bfloat16)


@pytest.mark.slow
def test_packed_only_engines_refuse_per_request_determinism():
    from turbospec.tuning import build_engine

    engine = build_engine(EngineConfig("smollm2-135m", weight_format="int4", kv_cache_memory_gib=0.25), progress=False)
    for mode in ("llm42", "margin-gate"):
        with pytest.raises(ValueError, match="only packed weights"):
            engine.request_determinism(mode)
    assert engine.request_determinism(None) is None
