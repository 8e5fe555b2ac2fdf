"""The `turbospec` command line, run as a subprocess: output format, agreement with the Python API, and
bad input (exit code 2 and one line on stderr, never a traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from turbospec.models import registry

MODEL = "smollm2-135m"
THREADS = ["--num-threads", "1"]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "turbospec.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def assert_usage_error(done: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit code 2, a single 'turbospec: error: ...' line naming the problem, no traceback."""
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    line = lines[0]
    assert line.startswith("turbospec: error:"), line
    for needle in needles:
        assert needle in line, (needle, line)
    assert done.stdout == ""
    return line


def generate_args(*extra: str, model: str = MODEL, prompt: str = "Hello") -> list[str]:
    return ["generate", "--model", model, "--prompt", prompt, "--dtype", "float32", *THREADS, *extra]


# ----------------------------------------------------------------------------------------------- success
@pytest.mark.slow
def test_generate_json_matches_python_api() -> None:
    prompt = "Write one sentence about the sea."
    # --max-model-len 512 (as in-process below) only shrinks the KV cache: the default 4096 zero-fills 4 GiB
    done = run_cli("generate", "--model", MODEL, "--prompt", prompt, "--chat", "--max-tokens", "8", "--json",
                   "--dtype", "float32", *THREADS, "--max-model-len", "512")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    result = json.loads(done.stdout)
    assert {"text", "token_ids", "prompt_token_ids", "finish_reason"} <= set(result)
    assert isinstance(result["text"], str) and result["text"]
    assert 1 <= len(result["token_ids"]) <= 8
    assert result["finish_reason"] in ("length", "stop")
    if result["finish_reason"] == "length":
        assert len(result["token_ids"]) == 8

    from turbospec import LLM, SamplingParams

    llm = LLM(MODEL, dtype="float32", num_threads=1, progress=False, max_model_len=512)
    # the CLI's defaults: greedy (temperature 0), top_p 1, no top-k
    out = llm.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0.0, max_tokens=8),
                   use_tqdm=False)[0]
    assert result["prompt_token_ids"] == out.prompt_token_ids
    assert result["token_ids"] == out.outputs[0].token_ids
    assert result["text"] == out.outputs[0].text
    assert result["finish_reason"] == out.outputs[0].finish_reason


def test_models_lists_the_registry() -> None:
    done = run_cli("models")
    assert done.returncode == 0, done.stderr
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"):
        assert name in done.stdout
    lines = done.stdout.strip().splitlines()
    assert len(lines) == len(registry.REGISTRY)  # one line per model
    assert sorted(line.split()[0] for line in lines) == sorted(registry.REGISTRY)


# ----------------------------------------------------------------------------------------------- bad input
# None of these needs a model: they fail on validation before any weights are read.
@pytest.mark.parametrize(
    "args, needles",
    [
        pytest.param(generate_args(model="no-such-model"), ["no-such-model", "smollm2-135m", "gemma3-270m"],
                     id="unknown-model"),
        pytest.param(generate_args(prompt=""), ["prompt", "empty"], id="empty-prompt"),
        pytest.param(generate_args("--max-tokens", "0"), ["max_tokens", "0"], id="max-tokens-0"),
        pytest.param(generate_args("--temperature", "-1"), ["temperature", "-1"], id="temperature-neg"),
        pytest.param(generate_args("--top-p", "0"), ["top_p", "0"], id="top-p-0"),
        pytest.param(generate_args("--top-p", "1.5"), ["top_p", "1.5"], id="top-p-1.5"),
        pytest.param(generate_args("--top-k", "-2"), ["top_k", "-2"], id="top-k-neg2"),
        pytest.param(generate_args("--dtype", "int7"), ["int7", "float32"], id="dtype-int7"),
        pytest.param(["pull", "nonexistent-model"], ["nonexistent-model", "smollm2-135m"], id="pull-unknown"),
        pytest.param(["calibrate-margin", "--model", "smollm2-135m", "--safety", "0.5"], ["--safety", "0.5"],
                     id="calibrate-safety-below-1"),
        pytest.param(["calibrate-margin", "--model", "smollm2-135m", "--num-prompts", "0"], ["--num-prompts"],
                     id="calibrate-no-prompts"),
        pytest.param(generate_args("--verify-window", "0"), ["verify_window", "0"], id="verify-window-0"),
        pytest.param(generate_args("--margin-threshold", "-1"), ["margin_threshold", "-1"],
                     id="margin-threshold-negative"),
    ],
)
def test_bad_input_exits_2_with_one_line(args: list[str], needles: list[str]) -> None:
    assert_usage_error(run_cli(*args), *needles)


@pytest.mark.slow
def test_prompt_beyond_max_model_len() -> None:
    done = run_cli(*generate_args("--max-model-len", "64", "--max-tokens", "100", "--json"))
    assert_usage_error(done, "max_model_len=64", "100")


@pytest.fixture
def isolated_home(tmp_path: Path) -> dict[str, str]:
    """A private TURBOSPEC_HOME, so a half-read bad file never leaves weight caches in the real one."""
    home = tmp_path / "home"
    home.mkdir()
    return {"TURBOSPEC_HOME": str(home)}


@pytest.mark.slow
def test_truncated_gguf(tmp_path: Path, isolated_home: dict[str, str]) -> None:
    real = registry.gguf_path(MODEL)
    assert real.exists(), f"{MODEL} is not pulled"
    bad = tmp_path / "x.gguf"
    with open(real, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(1 << 20))
    done = run_cli(*generate_args("--json", model=str(bad)), env=isolated_home)
    assert_usage_error(done, "x.gguf")


def test_random_bytes_gguf(tmp_path: Path, isolated_home: dict[str, str]) -> None:
    bad = tmp_path / "noise.gguf"
    bad.write_bytes(os.urandom(256 << 10))
    done = run_cli(*generate_args("--json", model=str(bad)), env=isolated_home)
    assert_usage_error(done, "noise.gguf")
