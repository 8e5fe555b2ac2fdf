"""Weight formats against the peers a CPU user would pick: HF transformers and llama.cpp, one run.

Single stream, greedy, batch 1, chat template, at most --max-tokens answer tokens, on the first MT-Bench turns
and HumanEval tasks (the task's prompt pre-filled in a code fence, as the other benchmarks do), for one model:
- HF transformers plain and with its prompt lookup (bf16, the GGUF dequantised);
- llama.cpp plain and with its prompt lookup (llama-cpp-python on the same Q4_K_M file, built from source:
  benchmarks/peers/llama_cpp_runner.py says how);
- turbospec plain in each weight format (bf16, int4, auto; auto also without our AMX kernels), with its best
  speculative settings (draft model and prompt lookup, k fixed) and with the goodput controller choosing k
  (auto weights; for the draft model and for prompt lookup);
- the prefill's share: every single-stream row runs its prompts again for one token each;
- 16 concurrent requests: output tokens/s of turbospec (continuous batching) against llama.cpp's Python API, which
  decodes one sequence at a time (so does its server).
Every row runs in its own process, so each row's peak resident memory is its own. One profile of a plain
decode step says where the time goes.

    .venv/bin/python benchmarks/weight_formats.py                          # full run (about 30 minutes here)
    .venv/bin/python benchmarks/weight_formats.py --prompts 1 --max-tokens 16 --rows turbospec-auto --out /tmp/wf
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from harness import benchmark_meta, default_out, hf_run_set, load_hf, run_sets, save, stats, warm_up  # noqa: E402

DRAFT = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}
SINGLE = ("hf-plain", "hf-prompt-lookup", "llama.cpp-plain", "llama.cpp-plain-avx2", "llama.cpp-prompt-lookup",
          "turbospec-bf16", "turbospec-auto-avx2", "turbospec-pld-k4-avx2", "turbospec-adaptive-avx2",
          "turbospec-auto-q8act-avx2", "turbospec-pld-k4-q8act-avx2", "turbospec-adaptive-q8act-avx2",
          "turbospec-int4", "turbospec-auto", "turbospec-auto-noamx", "turbospec-auto-nodpbf16", "turbospec-auto-nofused",
          "turbospec-pld-k4", "turbospec-sps-k4",
          "turbospec-sps-k4-int4draft", "turbospec-sps-auto", "turbospec-adaptive", "turbospec-auto-q8act",
          "turbospec-pld-k4-q8act", "turbospec-adaptive-q8act", "turbospec-eagle", "turbospec-eagle-q8act")
NO_AMX = "-noamx"  # rows run with TURBOSPEC_NO_AMX=1: torch's int4 and our AVX-512 int8 kernel, side by side
# ... and with TURBOSPEC_NO_DPBF16=1 on CPUs without AMX: none of our AVX512-BF16 kernels (packed records, bf16 rows)
NO_DPBF16 = "-nodpbf16"
# ... and with TURBOSPEC_NO_FUSED_LAYERS=1: every decoder layer run from Python (models/fused_layers.py)
NO_FUSED = "-nofused"
# ... and with TURBOSPEC_CPU_PATH=avx2: what a CPU without AVX-512 runs (turbospec/cpu_path.py); llama.cpp's
# -avx2 row runs a llama-cpp-python built for AVX2 only (--llamacpp-avx2-python), and these rows are compared with it
AVX2 = "-avx2"
ROW_ENV = {NO_AMX: ("TURBOSPEC_NO_AMX", "1"), NO_DPBF16: ("TURBOSPEC_NO_DPBF16", "1"),
           NO_FUSED: ("TURBOSPEC_NO_FUSED_LAYERS", "1"), AVX2: ("TURBOSPEC_CPU_PATH", "avx2")}
CONCURRENT = ("llama.cpp-16", "turbospec-auto-16", "turbospec-adaptive-16")
# plain rows whose decode step is also profiled: products, other operators, Python and dispatch
PROFILED = ("turbospec-auto", "turbospec-auto-q8act", "turbospec-auto-avx2", "turbospec-auto-q8act-avx2")


Q8ACT = "-q8act"  # rows with the packed products' activations in int8 (weight format auto-q8act)


def turbospec_options(row: str, model: str) -> tuple[str, dict[str, Any] | None]:
    """(weight format, speculative config) of a turbospec row."""
    if row.endswith(AVX2):
        return turbospec_options(row.removesuffix(AVX2), model)
    if row.endswith(Q8ACT):
        fmt, spec = turbospec_options(row.removesuffix(Q8ACT), model)
        assert fmt == "auto", row
        return "auto-q8act", spec
    if row == "turbospec-bf16":
        return "bf16", None
    if row == "turbospec-int4":
        return "int4", None
    if row in ("turbospec-auto", "turbospec-auto-16", *(f"turbospec-auto{end}" for end in ROW_ENV if end != AVX2)):
        return "auto", None
    if row == "turbospec-pld-k4":
        return "auto", {"method": "ngram", "num_speculative_tokens": 4}
    if row == "turbospec-sps-auto":  # the goodput controller picks k for the draft model, 0 where it does not pay
        return "auto", {"method": "draft", "model": DRAFT[model], "num_speculative_tokens": "auto"}
    if row == "turbospec-sps-k4":
        return "auto", {"method": "draft", "model": DRAFT[model], "num_speculative_tokens": 4}
    if row == "turbospec-sps-k4-int4draft":  # the draft's Q5_0 / Q8_0 layers rounded to 4 bits (lossy for it only)
        return "auto", {"method": "draft", "model": DRAFT[model], "num_speculative_tokens": 4, "quantization": "int4"}
    if row == "turbospec-adaptive":  # prompt lookup, the controller choosing k (was the draft row again until stop 24)
        return "auto", {"method": "ngram", "num_speculative_tokens": "auto"}
    if row == "turbospec-eagle":  # the committed EAGLE head, its tree, the controller choosing how much to verify
        return "auto", {"method": "eagle"}
    if row == "turbospec-adaptive-16":
        return "auto", {"method": "ngram", "num_speculative_tokens": "auto"}
    raise ValueError(row)


def peak_rss_mib() -> float:
    """This process's peak resident memory. VmHWM, not ru_maxrss: a forked child inherits its parent's
    ru_maxrss, while VmHWM belongs to the address space exec made."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_turbospec(job: dict[str, Any]) -> dict[str, Any]:
    from turbospec import LLM, SamplingParams

    fmt, spec = turbospec_options(job["row"], job["model"])
    # a KV cache for 16 sequences of 2,048 tokens at most (llama.cpp's runner gets n_ctx 2048), not the default 4 GiB
    llm = LLM(job["model"], weight_format=fmt, speculative_config=spec, num_threads=job["threads"], progress=False,
              enable_prefix_caching=False, max_num_seqs=16, max_model_len=2048,
              kv_cache_memory_gib=1.0 if job["row"].endswith("-16") else 0.25)
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"])
    warm_up(llm, job["sets"]["mt-bench"][0])  # (and the controller's step-time profile, cached)
    result: dict[str, Any] = {"weights": llm.engine.loaded.weights.line(), "sets": {}}
    if job["row"].endswith("-16"):
        prompts = [{"prompt_token_ids": ids} for ids in job["concurrent"]]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        result["sets"]["concurrent-16"] = {"seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
    else:  # the prefill's share of each set's seconds: the same prompts again, one token each
        sets = run_sets({job["row"]: llm}, job["sets"], params, measure_prefill=True, leave=False)[job["row"]]
        result["sets"] = {name: {k: s[k] for k in ("outputs", "seconds", "tokens", "tau", "mean_k", "prefill_seconds")}
                          for name, s in sets.items()}
    if job.get("profile"):
        result["profile"] = profile_decode(llm, job["sets"]["humaneval"][0])
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def profile_decode(llm: Any, ids: list[int], steps: int = 16) -> dict[str, Any]:
    """Where a plain decode step's time goes: self CPU time by operator over `steps` steps (torch profiler), split
    into the weight products, the other operators, and Python and dispatch between operators (the profiled wall
    time less every operator's self time); the weight bytes a step reads, as GB/s of the unprofiled step time and
    of the products' time, beside the machine's streaming read bandwidth."""
    from torch.profiler import ProfilerActivity, profile

    from harness import measure_bandwidth
    from turbospec import SamplingParams

    engine = llm.engine
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True))
    while engine.requests[rid].is_prefilling or engine.requests[rid].num_computed_tokens == 0:
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - start) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled_ms = (time.perf_counter() - start) * 1e3 / steps
    engine.abort_request(rid)
    events = prof.key_averages()
    ops_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    products_ms = sum(e.self_cpu_time_total for e in events if _is_product(e.key)) / 1e3 / steps
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    nbytes = decode_bytes(engine.loaded.model)
    bandwidth = measure_bandwidth(1.0)["gb_per_s"]
    return {"step_ms": step_ms, "profiled_ms": profiled_ms, "products_ms": products_ms,
            "other_ops_ms": ops_ms - products_ms, "python_ms": profiled_ms - ops_ms,
            "python_share": (profiled_ms - ops_ms) / profiled_ms, "bytes_per_step": nbytes,
            "step_gb_s": nbytes / step_ms / 1e6, "products_gb_s": nbytes / products_ms / 1e6,
            "stream_gb_s": bandwidth,
            "operators": [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                           "calls_per_step": e.count / steps} for e in top]}


def _is_product(op: str) -> bool:
    """A weight product: our packed / bf16-rows kernels, torch's int4 and dense matmuls."""
    return op.endswith("_mm") or op in ("aten::mm", "aten::addmm", "aten::_weight_int4pack_mm_for_cpu")


def decode_bytes(net: Any) -> int:
    """Weight bytes one decode step reads: each linear's packed form where one row runs packed, else its dense
    weight; the LM head likewise (the tied embedding when there is no head of its own)."""
    import torch

    total = 0
    for module in net.modules():
        if module is net.lm_head:  # counted below, in the form it runs
            continue
        packed = getattr(module, "packed", None)
        weight = getattr(module, "weight", None)
        if packed is not None and (weight is None or packed.runs_packed(1)):
            total += packed.nbytes
        elif isinstance(module, torch.nn.Linear) and weight is not None:
            total += weight.numel() * weight.element_size()
    head = net.lm_head_packed
    if head is not None and head.runs_packed(1):
        return total + head.nbytes
    dense_head = net.lm_head_weight
    return total + dense_head.numel() * dense_head.element_size()


def run_hf(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    model = load_hf(job["model"], "bfloat16")
    torch.set_num_threads(job["threads"])
    extra = {"prompt_lookup_num_tokens": 4} if job["row"] == "hf-prompt-lookup" else {}
    result: dict[str, Any] = {"sets": {name: hf_run_set(model, sets, job["max_tokens"], job["eos"],
                                                         desc=f"{job['row']} {name}", leave=False, **extra)
                                       for name, sets in job["sets"].items()}}
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def run_llama_cpp(job: dict[str, Any], python: str, tmp: Path) -> dict[str, Any]:
    from turbospec.models.registry import pull

    gguf = str(pull(job["model"], progress=False))
    mode = {"llama.cpp-plain": "plain", "llama.cpp-plain-avx2": "plain", "llama.cpp-prompt-lookup": "prompt-lookup",
            "llama.cpp-16": "plain"}[job["row"]]
    result: dict[str, Any] = {"sets": {}}
    peak = 0.0
    sets = {"concurrent-16": job["concurrent"]} if job["row"] == "llama.cpp-16" else job["sets"]
    for name, prompts in sets.items():
        spec = tmp / f"{job['row']}-{name}.json"
        out = tmp / f"{job['row']}-{name}.out.json"
        spec.write_text(json.dumps({"gguf": gguf, "prompts": prompts, "max_tokens": job["max_tokens"],
                                    "threads": job["threads"], "mode": mode, "k": 4,
                                    "measure_prefill": name != "concurrent-16"}))
        subprocess.run([python, str(ROOT / "peers" / "llama_cpp_runner.py"), str(spec), str(out)], check=True)
        got = json.loads(out.read_text())
        seconds = got["wall_seconds"] if name == "concurrent-16" else got["seconds"]
        result["sets"][name] = {"seconds": seconds, "tokens": got["tokens"], "tau": None,
                                "prefill_seconds": got.get("prefill_seconds")}
        peak = max(peak, got["peak_rss_mib"])
    result["peak_rss_mib"] = peak
    return result


def build_job(args: argparse.Namespace) -> dict[str, Any]:
    from turbospec.bench.humaneval import answer_prefix, load_humaneval
    from turbospec.bench.humaneval import chat_messages as humaneval_messages
    from turbospec.data.prompts import load_mtbench
    from turbospec.models.loader import load_model

    tok = load_model(args.model, "bfloat16", progress=False, weight_format="bf16").tokenizer
    count = max(args.prompts, 8)  # the 16 concurrent requests take 8 of each
    mt = [tok.apply_chat_template([{"role": "user", "content": p.text}]) for p in load_mtbench(count)]
    he = [tok.apply_chat_template(humaneval_messages(t)) + tok.encode(answer_prefix(t), add_special_tokens=False)
          for t in load_humaneval(count)]
    return {"model": args.model, "max_tokens": args.max_tokens, "threads": args.threads,
            "sets": {"mt-bench": mt[:args.prompts], "humaneval": he[:args.prompts]},
            "concurrent": [p for pair in zip(mt, he) for p in pair][:16], "eos": list(tok.eos_token_ids)}


def child(args: argparse.Namespace) -> None:
    job = json.loads(Path(args.job).read_text())
    result = run_hf(job) if job["row"].startswith("hf-") else run_turbospec(job)
    Path(args.result).write_text(json.dumps(result))


def tok_s(row: dict[str, Any], name: str) -> float | None:
    s = row["sets"].get(name)
    return stats.tok_s(s["tokens"], s["seconds"]) if s else None


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    by_name = {r["row"]: r for r in rows}
    lines = [f"# Weight formats vs HF transformers and llama.cpp: {meta['model']}", "",
             f"- {meta['command']}", f"- {meta['machine']}, {meta['threads']} threads, torch {meta['torch']}, "
             f"{meta['date']}, commit {meta['commit']}",
             f"- single stream, greedy, chat template, at most {meta['max_tokens']} tokens, {meta['prompts']} MT-Bench "
             "first turns + the same number of HumanEval tasks; 16 concurrent: 8 of each, at once", "",
             "prefill s: the same prompts run again for one token each, the prefill's share of the time (all prompts)",
             "",
             "| row | MT-Bench tok/s | HumanEval tok/s | tau MT / HE | mean k MT / HE | vs llama.cpp plain MT / HE (-avx2 "
             "rows: vs llama.cpp-plain-avx2) "
             "| prefill s MT / HE | peak RSS MiB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "concurrent-16" in r["sets"]:
            continue
        mt, he = tok_s(r, "mt-bench"), tok_s(r, "humaneval")
        # each row against llama.cpp on the same instructions: the AVX2 rows against llama.cpp built for AVX2
        ref = by_name.get("llama.cpp-plain-avx2" if r["row"].endswith(AVX2) else "llama.cpp-plain")
        tau = " / ".join(f"{t:.2f}" if (t := r["sets"][n].get("tau")) else "-" for n in ("mt-bench", "humaneval"))
        mean_k = " / ".join(f"{k:.1f}" if (k := r["sets"][n].get("mean_k")) is not None else "-"
                            for n in ("mt-bench", "humaneval"))
        vs = (f"{mt / tok_s(ref, 'mt-bench'):.2f}x / {he / tok_s(ref, 'humaneval'):.2f}x" if ref else "-")
        prefill = " / ".join(f"{p:.1f}" if (p := r["sets"][n].get("prefill_seconds")) else "-"
                             for n in ("mt-bench", "humaneval"))
        lines.append(f"| {r['row']} | {mt:.2f} | {he:.2f} | {tau} | {mean_k} | {vs} | {prefill} | "
                     f"{r['peak_rss_mib']:.0f} |")
    conc = [r for r in rows if "concurrent-16" in r["sets"]]
    if conc:
        base = next((r for r in conc if r["row"] == "llama.cpp-16"), None)
        lines += ["", "| 16 concurrent requests | output tok/s | vs llama.cpp | peak RSS MiB |", "|---|---|---|---|"]
        for r in conc:
            t = tok_s(r, "concurrent-16")
            vs = f"{t / tok_s(base, 'concurrent-16'):.2f}x" if base else "-"
            lines.append(f"| {r['row']} | {t:.2f} | {vs} | {r['peak_rss_mib']:.0f} |")
    lines += agreement_lines(rows)
    weights = [(r["row"], r["weights"]) for r in rows if r.get("weights")]
    if weights:
        lines += ["", "Weights kept (load log):", ""] + [f"- {row}: {w}" for row, w in weights]
    for row, prof in ((r["row"], r["profile"]) for r in rows if r.get("profile")):
        lines += ["", f"Where a plain decode step goes ({row}, torch profiler, self CPU time):", "",
                  f"- step {prof['step_ms']:.1f} ms ({prof['profiled_ms']:.1f} ms profiled): weight products "
                  f"{prof['products_ms']:.1f} ms, other operators {prof['other_ops_ms']:.1f} ms, Python and dispatch "
                  f"between operators {prof['python_ms']:.1f} ms ({100 * prof['python_share']:.0f}% of the profiled step)",
                  f"- weights read per step {prof['bytes_per_step'] / 1e6:.0f} MB: {prof['step_gb_s']:.1f} GB/s over the "
                  f"step, {prof['products_gb_s']:.1f} GB/s over the products; streaming read bandwidth "
                  f"{prof['stream_gb_s']:.1f} GB/s (step: {100 * prof['step_gb_s'] / prof['stream_gb_s']:.0f}% of it)", "",
                  "| operator | ms per step | calls per step |", "|---|---|---|"]
        lines += [f"| {p['op']} | {p['ms_per_step']:.2f} | {p['calls_per_step']:.0f} |" for p in prof["operators"]]
    return "\n".join(lines) + "\n"


def agreement_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Greedy agreement of each int8-activation row with the same row on float activations (a lossy format must
    say how far it moves the output): outputs identical, and the mean share of tokens before the first difference."""
    by_name = {r["row"]: r for r in rows}
    lines = []
    for r in rows:
        base = by_name.get(r["row"].replace(Q8ACT, "", 1)) if Q8ACT in r["row"] else None  # (…-q8act-avx2 too)
        if base is None or "concurrent-16" in r["sets"]:
            continue
        pairs = [(a, b) for n in ("mt-bench", "humaneval") for a, b in zip(r["sets"][n]["outputs"],
                                                                            base["sets"][n]["outputs"])]
        same = sum(a == b for a, b in pairs)
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) / max(len(b), 1)
                  for a, b in pairs]
        lines.append(f"- {r['row']} against {base['row']}: {same} of {len(pairs)} greedy outputs identical; on "
                     f"average the first {100 * sum(prefix) / len(prefix):.0f}% of the tokens agree")
    return ["", "Greedy agreement of the int8-activation rows with float activations:", "", *lines] if lines else []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--prompts", type=int, default=3, help="per data set")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default=",".join(SINGLE + CONCURRENT))
    p.add_argument("--llamacpp-python", default="/tmp/llamacpp-venv/bin/python")
    p.add_argument("--llamacpp-avx2-python", default="/tmp/llamacpp-avx2-venv/bin/python",
                   help="a llama-cpp-python built with GGML_NATIVE=OFF GGML_AVX2=ON GGML_AVX512=OFF (row llama.cpp-plain-avx2)")
    p.add_argument("--out", default=str(default_out("weight_formats")))
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:
        return child(args)
    if args.prompts < 1 or args.max_tokens < 1:
        p.error(f"--prompts {args.prompts} --max-tokens {args.max_tokens}: both must be at least 1")
    rows_wanted = args.rows.split(",")
    unknown = set(rows_wanted) - set(SINGLE + CONCURRENT)
    if unknown:
        p.error(f"unknown rows {sorted(unknown)}: expected some of {', '.join(SINGLE + CONCURRENT)}")
    var, value = ROW_ENV[AVX2]
    if all(r.endswith(AVX2) for r in rows_wanted) and os.environ.get(var) != value:
        # every row runs the AVX2 path: so does this process, so the result's machine line says so (and the results
        # index files it under AVX2, not under the CPU's own vector units)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, var: value})
    out = Path(args.out)
    partial = out.with_suffix(".partial.json")
    done = {r["row"]: r for r in json.loads(partial.read_text())["rows"]} if partial.exists() else {}
    job = build_job(args)
    meta = benchmark_meta(args.threads, model=args.model, prompts=args.prompts, max_tokens=args.max_tokens)
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for row in tqdm(rows_wanted, desc="rows", unit="row"):
            if row in done:
                continue
            row_job = {**job, "row": row, "profile": row in PROFILED}
            if row.startswith("llama.cpp"):
                python = args.llamacpp_avx2_python if row.endswith(AVX2) else args.llamacpp_python
                result = run_llama_cpp(row_job, python, tmp)
            else:
                (tmp / "job.json").write_text(json.dumps(row_job))
                env = next(({**os.environ, var: value} for end, (var, value) in ROW_ENV.items() if row.endswith(end)),
                           None)
                subprocess.run([sys.executable, __file__, "--job", str(tmp / "job.json"), "--result",
                                str(tmp / "result.json")], check=True, env=env)
                result = json.loads((tmp / "result.json").read_text())
            done[row] = {"row": row, **result}
            summary = {n: round(tok_s(done[row], n) or 0, 2) for n in done[row]["sets"]}
            tqdm.write(f"{row}: {summary} tok/s, peak {done[row]['peak_rss_mib']:.0f} MiB")
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"meta": meta, "rows": list(done.values())}))
    rows = [done[r] for r in rows_wanted]
    save(out, meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
