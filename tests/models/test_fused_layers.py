"""The compiled decoder layer (kernels/decoder_layer.cpp, models/fused_layers.py) computes the same bits as the
Python layers on every step it takes: decodes, batches of decodes, verification windows and trees; and it leaves
every other step to the Python layers."""

from __future__ import annotations

import pytest
import torch

from turbospec import LLM, SamplingParams, attention_choice, kernels
from turbospec.models import fused_layers
from turbospec.models.crossover import Crossover, CrossoverCache
from turbospec.models.fused_layers import FusedLayers
from turbospec.models.llama import CausalLM, DecoderLayer

pytestmark = pytest.mark.skipif(not kernels.records_path(),
                                reason="the compiled layer runs packed records: CPUs with AMX or AVX512-BF16 only")

MODEL = "smollm2-135m"
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The capital of France is Paris. The capital of France is",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,"]


@pytest.fixture(autouse=True)
def fused_attention():
    """The compiled layer runs only where attention takes the fused kernel, which this machine's measured choice
    may not give for every window length and context: fixed here, so that every step of the tests can run it."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv(attention_choice.OVERRIDE, "fused")
        attention_choice.forget()
        yield
    attention_choice.forget()


class StepLog:
    """Counts the steps each path ran, by the rows and attention groups of the step."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fused: list[tuple[int, int]] = []
        self.python = 0
        original = FusedLayers.for_step

        def logged(plan: FusedLayers, x: torch.Tensor, positions, meta, kv_caches, rotary):
            call = original(plan, x, positions, meta, kv_caches, rotary)
            if call is None:
                self.python += 1
            else:
                self.fused.append((x.shape[0], len(meta.groups)))
            return call

        monkeypatch.setattr(FusedLayers, "for_step", logged)


def _llm(speculative_config=None) -> LLM:
    # every linear packed up to 64 rows whatever this machine's crossover says (which may keep a small linear dense
    # where our kernel is compute-bound, as on AVX2), so that every step of the test can run the compiled layer;
    # both paths then run the same products
    with pytest.MonkeyPatch.context() as m:
        m.setattr(CrossoverCache, "get", lambda *_: Crossover(max_rows=64, gemm_rows=0))
        llm = LLM(MODEL, dtype="bfloat16", weight_format="auto", kv_cache_memory_gib=0.25, progress=False,
                  speculative_config=speculative_config, enable_prefix_caching=False)
    net = llm.engine.loaded.model
    # a qkv bias (SmolLM2 has none; Qwen2 has one): the compiled layer adds it as the Python one does
    gen = torch.Generator().manual_seed(0)
    for layer in net.layers:
        qkv = layer.attn.qkv
        qkv.bias = torch.nn.Parameter((torch.randn(qkv.out_features, generator=gen) * 0.05).to(torch.bfloat16),
                                      requires_grad=False)
    return llm


def _generate_both(llm: LLM, params: SamplingParams, monkeypatch: pytest.MonkeyPatch):
    """(outputs with the compiled layers, outputs with the Python layers, the step log of the first)."""
    log = StepLog(monkeypatch)
    fused = llm.generate(PROMPTS, params, use_tqdm=False)
    with monkeypatch.context() as m:
        m.setattr(CausalLM, "fused_layers", lambda *_: None)
        python = llm.generate(PROMPTS, params, use_tqdm=False)
    return fused, python, log


def _same(a, b) -> None:
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        # the chosen tokens' log-probabilities: the same logits to the last bit, not only the same argmax
        chosen = [[entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in (x, y)]
        assert chosen[0] == chosen[1]


def test_decodes_and_batches_of_decodes_are_the_python_layers_bits(monkeypatch):
    llm = _llm()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in (12, 4, 6)]
    fused, python, log = _generate_both(llm, params, monkeypatch)
    _same(fused, python)
    assert {rows for rows, _ in log.fused} >= {1, 2, 3}  # three sequences together, then two, then one alone
    assert log.python >= 1  # the prompts' prefill is not a decode-sized step


def test_verification_windows_and_trees_are_the_python_layers_bits(monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    for config in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
                   {"method": "eagle", "num_speculative_tokens": 6, "tree_depth": 3}):
        llm = _llm(config)
        with pytest.MonkeyPatch.context() as m:
            fused, python, log = _generate_both(llm, params, m)
        _same(fused, python)
        assert any(rows > len(PROMPTS) for rows, _ in log.fused), config  # windows of several rows per sequence


def test_steps_it_cannot_compute_exactly_run_the_python_layers(monkeypatch):
    llm = _llm()
    net = llm.engine.loaded.model
    log = StepLog(monkeypatch)
    llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert log.fused and log.python  # decodes compiled, the prefill in Python
    for module in net.modules():  # a linear that runs dense for one row: the whole step runs the Python layers
        if getattr(module, "packed", None) is not None:
            module.packed.max_rows = 0
            break
    net._fused._fits_rows.clear()
    before = len(log.fused)
    llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(log.fused) == before


def test_a_model_without_packed_records_or_with_the_switch_off_has_no_compiled_layers(monkeypatch):
    dense = LLM(MODEL, dtype="bfloat16", weight_format="bf16", kv_cache_memory_gib=0.25, progress=False)
    assert FusedLayers.build(dense.engine.loaded.model, DecoderLayer) is None
    packed = _llm()
    assert FusedLayers.build(packed.engine.loaded.model, DecoderLayer) is not None
    monkeypatch.setattr(fused_layers, "_DISABLED", True)
    assert FusedLayers.build(packed.engine.loaded.model, DecoderLayer) is None
