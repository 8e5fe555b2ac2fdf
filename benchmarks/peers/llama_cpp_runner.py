"""llama.cpp on the same prompts, run by a Python that has llama-cpp-python (the benchmark's peer only).

Reads a JSON job {gguf, prompts: [[token ids]], max_tokens, threads, mode: plain|prompt-lookup, measure_prefill}
from argv[1] and writes {outputs, seconds, prefill_seconds, tokens, peak_rss_mib} to argv[2]. Standard library +
llama_cpp only: it runs in its own virtual environment. How that environment is built (from the sdist, as
REFERENCE.md section 7 says; a prebuilt wheel dies with SIGILL on this CPU):

    python3.11 -m venv /tmp/llamacpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
        -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
        /tmp/llamacpp-venv/bin/pip install --no-cache-dir --no-binary llama-cpp-python \
        'llama-cpp-python[server]==0.3.36'

Every AVX-512 extension the Xeon has, but not llama.cpp's AMX path: built with GGML_NATIVE=ON (which turns it on)
it dies with SIGILL on its first matmul here (`tilezero` in ggml_backend_amx_mul_mat, a thread whose tiles were
never configured; requesting the tile permission first does not help). --no-cache-dir: pip otherwise reuses the
wheel it built before, whatever CMAKE_ARGS say.
"""

from __future__ import annotations

import json
import resource
import sys
import time

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def peak_rss_mib() -> float:
    """VmHWM: ru_maxrss would include the parent's peak, inherited at fork."""
    for line in open("/proc/self/status").read().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    draft = LlamaPromptLookupDecoding(num_pred_tokens=job.get("k", 4)) if job["mode"] == "prompt-lookup" else None
    llm = Llama(job["gguf"], n_ctx=2048, n_threads=job["threads"], n_threads_batch=job["threads"], verbose=False,
                draft_model=draft, seed=0)
    llm.create_completion(prompt=job["prompts"][0], max_tokens=4, temperature=0.0)  # warm-up
    outputs, seconds = [], 0.0
    start_all = time.perf_counter()
    for ids in job["prompts"]:  # one at a time: the Python API (and its server) decodes one sequence at once
        llm.reset()
        start = time.perf_counter()
        out = llm.create_completion(prompt=ids, max_tokens=job["max_tokens"], temperature=0.0, top_k=1)
        seconds += time.perf_counter() - start
        outputs.append(out["usage"]["completion_tokens"])
        print(f"llama.cpp {job['mode']}: {sum(outputs)} tokens, {sum(outputs) / seconds:.2f} tok/s", flush=True)
    wall = time.perf_counter() - start_all
    prefill = 0.0  # the same prompts again, one token each: the prefill's share of `seconds`
    if job.get("measure_prefill", True):
        for ids in job["prompts"]:
            llm.reset()
            start = time.perf_counter()
            llm.create_completion(prompt=ids, max_tokens=1, temperature=0.0, top_k=1)
            prefill += time.perf_counter() - start
    result = {"tokens_per_prompt": outputs, "seconds": seconds, "wall_seconds": wall, "prefill_seconds": prefill,
              "tokens": sum(outputs), "peak_rss_mib": peak_rss_mib()}
    open(sys.argv[2], "w").write(json.dumps(result))


if __name__ == "__main__":
    main()
