"""TURBOSPEC_CPU_PATH: a forced path switches the kernels off as a CPU without them would; a path the CPU lacks, or
an unknown value, is refused (CLI exit code 2) before any model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from turbospec import cpu_path

AVX2_ONLY = {"sse4_2", "avx", "avx2", "fma", "f16c"}
ZEN4 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}


def test_a_path_the_cpu_lacks_or_an_unknown_value_says_why():
    assert cpu_path.problem("auto", AVX2_ONLY) is None
    assert cpu_path.problem("avx2", AVX2_ONLY) is None
    assert cpu_path.problem("avx512", ZEN4) is None
    lacking = cpu_path.problem("avx512", AVX2_ONLY)
    assert "lacks avx512f, avx512bw" in lacking and "TURBOSPEC_CPU_PATH" in lacking
    assert "lacks avx2, fma" in cpu_path.problem("avx2", {"sse4_2"})
    assert "expected one of auto, avx512, avx2" in cpu_path.problem("avx9", ZEN4)


def test_a_cpu_without_avx2_gets_one_line_saying_what_runs_instead():
    assert cpu_path.no_avx2_line(ZEN4) is None
    line = cpu_path.no_avx2_line({"sse4_2", "avx"})
    assert "no AVX2" in line and "portable" in line and "\n" not in line


def _run(code: str, path: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TURBOSPEC_CPU_PATH": path}
    for name in ("TURBOSPEC_NO_AMX", "TURBOSPEC_NO_DPBF16", "TURBOSPEC_NO_VNNI", "TURBOSPEC_NO_AVX512",
                 "ATEN_CPU_CAPABILITY"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)


def test_the_cli_refuses_a_forced_path_before_loading_a_model():
    got = _run("import sys; from turbospec.cli import main; sys.exit(main(sys.argv[1:]))", "avx9",
               "generate", "--model", "smollm2-135m", "--prompt", "hi", "--max-tokens", "2")
    assert got.returncode == 2
    assert "TURBOSPEC_CPU_PATH='avx9' is not a CPU path" in got.stderr
    assert "Traceback" not in got.stderr
    refused = _run("from turbospec.config import EngineConfig; EngineConfig('smollm2-135m')", "avx9")
    assert refused.returncode != 0 and "not a CPU path" in refused.stderr


@pytest.mark.skipif(cpu_path.problem("avx2") is not None, reason="this CPU has no AVX2 + FMA")
def test_the_avx2_path_runs_no_avx512_kernel_and_still_decodes():
    code = """
import json, torch
from turbospec import LLM, SamplingParams, kernels
llm = LLM("smollm2-135m", weight_format="auto", kv_cache_memory_gib=0.1, progress=False)
out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "records": kernels.records_path(),
                  "q8": kernels.q8_records_available(), "bf16_rows": kernels.bf16_rows_path(),
                  "tokens": len(out[0].outputs[0].token_ids)}))
"""
    got = _run(code, "avx2")
    assert got.returncode == 0, got.stderr[-2000:]
    seen = json.loads(got.stdout.strip().splitlines()[-1])
    # the packed records run the AVX2 kernel (int8 activations, records_avx2.cpp), not the AVX512-BF16 one
    assert seen == {"capability": "AVX2", "records": "avx2", "q8": True, "bf16_rows": "avx2", "tokens": 4}


def test_a_forced_path_is_what_a_benchmark_says_it_ran_on(monkeypatch):
    """A benchmark run under a forced path files its result under the class it imitates, and says it was forced."""
    from turbospec.bench.machine import cpu_description

    flags = {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}
    monkeypatch.setenv(cpu_path.VARIABLE, "avx2")
    assert cpu_path.flags_in_use(flags) == {"avx2", "fma"}
    assert cpu_description().endswith(f"[{cpu_path.VARIABLE}=avx2]") and "avx512" not in cpu_description()
    monkeypatch.setenv(cpu_path.VARIABLE, "avx512")
    assert cpu_path.flags_in_use(flags) == flags - {"amx_bf16"}
    monkeypatch.setenv(cpu_path.VARIABLE, "auto")
    assert cpu_path.flags_in_use(flags) == flags and "[" not in cpu_description()
