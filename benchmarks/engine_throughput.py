#!/usr/bin/env python
"""Engine benchmark: turbospec vs HF transformers on CPU, for each registry model x dtype.

Measures, in one run:
  1. single-stream greedy decode tokens/s (time to first token excluded), turbospec and HF ``generate``;
  2. throughput of ``--concurrency`` requests of ``--conc-max-tokens`` tokens each: turbospec continuous
     batching (one ``generate`` call), HF one request after another, and HF as one left-padded batch;
  3. the memory-bandwidth bound on single-stream decode: measured read bandwidth / weight bytes per step.

Writes ``<out>.json`` (raw numbers and metadata) and ``<out>.md`` (summary table); ``--out`` sets the stem
(default benchmarks/results/engine_throughput/engine_throughput).

Full run (on a quiet machine):  .venv/bin/python benchmarks/engine_throughput.py
Smoke test:  .venv/bin/python benchmarks/engine_throughput.py --models smollm2-135m --dtypes float32 \
    --max-tokens 8 --concurrency 2 --conc-max-tokens 4 --threads 1 --out /tmp/bench_test
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from turbospec.host import hardware_name  # noqa: E402
from turbospec import LLM, SamplingParams  # noqa: E402
from turbospec.bench import chat_messages, load_prompts  # noqa: E402
from turbospec.models.registry import gguf_path  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from harness import measure_bandwidth  # noqa: E402

MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
DTYPES = ("bfloat16", "float32")
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DEFAULT_OUT = REPO / "benchmarks" / "results" / "engine_throughput" / "engine_throughput"
GB = 1e9


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- metadata --------------------------------------------------------------------------------------------

def cpu_model() -> str:
    return hardware_name("cpu")


def git_commit() -> dict[str, Any]:
    def run(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": run("rev-parse", "HEAD"), "dirty": bool(run("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def metadata(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "hostname": platform.node(),
        "git": git_commit(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
    }


# --- bytes per step -------------------------------------------------------------------------------------

def weight_bytes(model: torch.nn.Module) -> dict[str, Any]:
    """Bytes of weights read per decode step: every distinct parameter once (a tied embedding is the LM head
    and is read in full); an untied input embedding only has one row per token gathered, so it is left out."""
    params = {p.data_ptr(): p for p in model.parameters()}  # a tied weight is one tensor: count it once
    total = sum(p.numel() * p.element_size() for p in params.values())
    untied = 0
    for emb in (m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)):
        heads = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.shape == emb.shape]
        # no LM head module (turbospec computes logits from the embedding) or one sharing its storage: tied
        if heads and all(h.data_ptr() != emb.data_ptr() for h in heads):
            untied += emb.numel() * emb.element_size()
    return {"param_bytes": total, "num_params": sum(p.numel() for p in params.values()),
            "tied_embedding": untied == 0, "untied_embedding_bytes": untied, "bytes_per_step": total - untied}


# --- turbospec ------------------------------------------------------------------------------------------

def reset_prefix_cache(llm: LLM) -> None:
    """Timed runs start cold, as HF has no prefix cache (warm-ups reuse the same prompts)."""
    blocks = getattr(llm.engine, "blocks", None)
    if blocks is not None and hasattr(blocks, "reset_prefix_cache"):
        blocks.reset_prefix_cache()


def ts_single(llm: LLM, ids: list[int], n: int) -> dict[str, Any]:
    """One greedy request driven step by step: time to first token and decode rate from the same run."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    rid = engine.add_request(ids, params)
    first = None
    tokens: list[int] = []
    steps = 0
    final = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        for o in outs:
            if o.request_id != rid:
                continue
            if o.delta_token_ids and first is None:
                first = time.perf_counter()
            tokens += o.delta_token_ids
            if o.finished:
                final = o
    end = time.perf_counter()
    assert first is not None and final is not None, "the request produced no tokens"
    got = final.outputs[0].token_ids
    if len(got) != n:
        log(f"  WARNING: turbospec returned {len(got)} tokens, asked for {n} (finish_reason={final.outputs[0].finish_reason})")
    decode_s = end - first
    return {"prompt_tokens": len(ids), "output_tokens": len(got), "total_s": end - start, "ttft_s": first - start,
            "decode_s": decode_s, "decode_tok_s": (len(got) - 1) / decode_s if decode_s > 0 else None,
            "steps": steps, "token_ids": got,
            "num_cached_tokens": final.metrics.num_cached_tokens if final.metrics else None}


def ts_concurrent(llm: LLM, batch: list[list[int]], n: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in batch]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    counts = [len(o.outputs[0].token_ids) for o in outs]
    if any(c != n for c in counts):
        log(f"  WARNING: turbospec output lengths {counts}, asked for {n} each")
    total = sum(counts)
    return {"requests": len(batch), "output_tokens": total, "total_s": elapsed, "tok_s": total / elapsed,
            "prompt_tokens": sum(len(b) for b in batch),
            "num_cached_tokens": sum(o.metrics.num_cached_tokens for o in outs if o.metrics)}


# --- HF transformers ----------------------------------------------------------------------------------------

class TimingStreamer:
    """Records when generate() hands over each chunk: the first put() is the prompt, then one per new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int, pad_id: int,
                streamer: Any = None) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                              max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id, streamer=streamer,
                              temperature=None, top_p=None, top_k=None)


def hf_single(model: Any, ids: list[int], n: int, pad_id: int) -> dict[str, Any]:
    """TTFT from a separate 1-token generate; decode rate = (n - 1) / (t(n tokens) - t(1 token))."""
    x = torch.tensor([ids])
    mask = torch.ones_like(x)
    start = time.perf_counter()
    hf_generate(model, x, mask, 1, pad_id)
    t1 = time.perf_counter() - start
    streamer = TimingStreamer()
    start = time.perf_counter()
    out = hf_generate(model, x, mask, n, pad_id, streamer)
    tn = time.perf_counter() - start
    got = out[0, len(ids):].tolist()
    if len(got) != n:
        log(f"  WARNING: HF returned {len(got)} tokens, asked for {n}")
    decode_s = tn - t1
    # Same-run alternative: time from the first generated token's put() to the end.
    stream_decode_s = (start + tn - streamer.times[1]) if len(streamer.times) > 1 else None
    return {"prompt_tokens": len(ids), "output_tokens": len(got), "total_s": tn, "ttft_s": t1, "decode_s": decode_s,
            "decode_tok_s": (len(got) - 1) / decode_s if decode_s > 0 else None,
            "stream_ttft_s": streamer.times[1] - start if len(streamer.times) > 1 else None,
            "stream_decode_tok_s": (len(got) - 1) / stream_decode_s if stream_decode_s else None,
            "token_ids": got}


def hf_sequential(model: Any, batch: list[list[int]], n: int, pad_id: int) -> dict[str, Any]:
    start = time.perf_counter()
    total = 0
    for ids in batch:
        x = torch.tensor([ids])
        out = hf_generate(model, x, torch.ones_like(x), n, pad_id)
        total += out.shape[1] - len(ids)
    elapsed = time.perf_counter() - start
    return {"requests": len(batch), "output_tokens": total, "total_s": elapsed, "tok_s": total / elapsed}


def hf_batch(model: Any, tokenizer: Any, batch: list[list[int]], n: int, pad_id: int) -> dict[str, Any]:
    enc = tokenizer.pad({"input_ids": batch}, padding=True, return_tensors="pt")
    start = time.perf_counter()
    out = hf_generate(model, enc["input_ids"], enc["attention_mask"], n, pad_id)
    elapsed = time.perf_counter() - start
    new = out.shape[1] - enc["input_ids"].shape[1]
    if new != n:
        log(f"  WARNING: HF batch generated {new} tokens per row, asked for {n}")
    total = new * len(batch)
    return {"requests": len(batch), "output_tokens": total, "total_s": elapsed, "tok_s": total / elapsed,
            "padded_len": int(enc["input_ids"].shape[1]), "prompt_tokens": sum(len(b) for b in batch)}


def load_hf(name: str, dtype: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(name)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=TORCH_DTYPES[dtype]).eval()
    return model, tok


# --- one model x dtype ----------------------------------------------------------------------------------------

def mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def common_prefix(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def build_prompt_ids(llm: LLM, n: int, source: str) -> tuple[list[list[int]], list[str], str]:
    prompts, used = load_prompts(n, source)
    tok = llm.get_tokenizer()
    return [list(tok.apply_chat_template(chat_messages(p), add_generation_prompt=True)) for p in prompts], \
        [p.id for p in prompts], used


def bench_one(name: str, dtype: str, args: argparse.Namespace, bandwidth: dict[str, Any]) -> dict[str, Any]:
    res: dict[str, Any] = {"model": name, "dtype": dtype}
    n, m, c = args.max_tokens, args.conc_max_tokens, args.concurrency

    # turbospec --------------------------------------------------------------------------------------
    log(f"{name} {dtype}: loading turbospec")
    start = time.perf_counter()
    extra = {"max_num_seqs": c} if c > 32 else {}
    llm = LLM(name, dtype=dtype, num_threads=args.threads, progress=False, **extra)
    res["turbospec_load_s"] = time.perf_counter() - start
    ids, prompt_ids, source = build_prompt_ids(llm, max(c, args.prompts), args.prompt_source)
    single_ids = ids[: args.prompts]
    res["prompts"] = {"source": source, "single_ids": prompt_ids[: args.prompts], "concurrent_ids": prompt_ids[:c],
                      "single_prompt_tokens": [len(x) for x in single_ids],
                      "concurrent_prompt_tokens": [len(x) for x in ids[:c]]}
    res["weights"] = weight_bytes(llm.engine.runner.model)

    ts_single(llm, single_ids[0], n)  # warm-up
    runs = []
    for i, x in enumerate(single_ids):
        reset_prefix_cache(llm)
        r = ts_single(llm, x, n)
        runs.append(r)
        log(f"  turbospec single [{i + 1}/{len(single_ids)}] prompt {r['prompt_tokens']} tok: "
            f"ttft {r['ttft_s'] * 1e3:.0f} ms, decode {r['decode_tok_s']:.2f} tok/s")
    res["turbospec_single"] = {"runs": runs, "mean_decode_tok_s": mean([r["decode_tok_s"] for r in runs]),
                               "mean_ttft_s": mean([r["ttft_s"] for r in runs])}

    ts_concurrent(llm, ids[:c], min(2, m))  # warm-up: the same batch shapes for prefill
    reset_prefix_cache(llm)
    r = ts_concurrent(llm, ids[:c], m)
    res["turbospec_concurrent"] = r
    log(f"  turbospec {c} req x {m} tok: {r['tok_s']:.2f} tok/s ({r['total_s']:.1f} s)")
    del llm
    gc.collect()

    # HF transformers -----------------------------------------------------------------------------------
    log(f"{name} {dtype}: loading HF transformers")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tok = load_hf(name, dtype)
    res["hf_load_s"] = time.perf_counter() - start
    pad_id = tok.pad_token_id
    res["hf_weights"] = weight_bytes(model)

    hf_single(model, single_ids[0], n, pad_id)  # warm-up
    runs = []
    for i, x in enumerate(single_ids):
        r = hf_single(model, x, n, pad_id)
        r["greedy_match_tokens"] = common_prefix(r["token_ids"], res["turbospec_single"]["runs"][i]["token_ids"])
        runs.append(r)
        log(f"  HF single [{i + 1}/{len(single_ids)}]: ttft {r['ttft_s'] * 1e3:.0f} ms, decode "
            f"{r['decode_tok_s']:.2f} tok/s (same-run {r['stream_decode_tok_s'] or 0:.2f}); greedy tokens equal to "
            f"turbospec for {r['greedy_match_tokens']}/{n}")
    res["hf_single"] = {"runs": runs, "mean_decode_tok_s": mean([r["decode_tok_s"] for r in runs]),
                        "mean_stream_decode_tok_s": mean([r["stream_decode_tok_s"] for r in runs]),
                        "mean_ttft_s": mean([r["ttft_s"] for r in runs])}

    r = hf_sequential(model, ids[:c], m, pad_id)
    res["hf_sequential"] = r
    log(f"  HF sequential {c} req x {m} tok: {r['tok_s']:.2f} tok/s ({r['total_s']:.1f} s)")
    hf_batch(model, tok, ids[:c], min(2, m), pad_id)  # warm-up
    r = hf_batch(model, tok, ids[:c], m, pad_id)
    res["hf_batch"] = r
    log(f"  HF batch {c} req x {m} tok: {r['tok_s']:.2f} tok/s ({r['total_s']:.1f} s)")
    del model, tok
    gc.collect()

    # summary ---------------------------------------------------------------------------------------------
    ours = res["turbospec_single"]["mean_decode_tok_s"]
    bound = bandwidth["gb_per_s"] * GB / res["weights"]["bytes_per_step"]
    res["summary"] = {
        "turbospec_tok_s": ours, "hf_tok_s": res["hf_single"]["mean_decode_tok_s"],
        "turbospec_over_hf": ratio(ours, res["hf_single"]["mean_decode_tok_s"]),
        "bound_tok_s": bound, "bound_over_turbospec": ratio(bound, ours),
        # the plain sum over distinct parameters, untied input embedding included
        "bound_all_params_tok_s": bandwidth["gb_per_s"] * GB / res["weights"]["param_bytes"],
        "turbospec_concurrent_tok_s": res["turbospec_concurrent"]["tok_s"],
        "hf_sequential_tok_s": res["hf_sequential"]["tok_s"], "hf_batch_tok_s": res["hf_batch"]["tok_s"],
        "turbospec_over_hf_sequential": ratio(res["turbospec_concurrent"]["tok_s"], res["hf_sequential"]["tok_s"]),
        "turbospec_over_hf_batch": ratio(res["turbospec_concurrent"]["tok_s"], res["hf_batch"]["tok_s"]),
    }
    s = res["summary"]
    log(f"{name} {dtype}: single {ours:.2f} vs HF {s['hf_tok_s']:.2f} tok/s (x{s['turbospec_over_hf']:.2f}), "
        f"bound {bound:.1f} tok/s (bound/ours {s['bound_over_turbospec']:.2f}); {c} req: "
        f"x{s['turbospec_over_hf_sequential']:.2f} vs HF seq, x{s['turbospec_over_hf_batch']:.2f} vs HF batch")
    return res


# --- output -------------------------------------------------------------------------------------------------

def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    meta, bw = report["metadata"], report["bandwidth"]
    st = meta["settings"]
    c = st["concurrency"]
    git = meta["git"]
    lines = [
        "# turbospec engine throughput", "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- machine: {meta['cpu_model']}, {meta['cpu_count']} logical CPUs, {meta['threads']} threads; "
        f"torch {meta['torch_version']}, transformers {meta['transformers_version']}",
        f"- git: {git['commit']}{' (dirty)' if git['dirty'] else ''}",
        f"- read bandwidth: {bw['gb_per_s']:.1f} GB/s ({bw['method']}, {bw['bytes'] / 2**30:.1f} GiB, best of "
        f"{len(bw['trials_s'])})",
        f"- single stream: greedy, {st['max_tokens']} tokens, decode tok/s = (N-1)/(total - TTFT), mean over "
        f"{st['prompts']} prompts ({report['results'][0]['prompts']['source'] if report['results'] else '-'})",
        f"- {c} requests: {st['conc_max_tokens']} output tokens each, greedy, ignore_eos; output tok/s incl. prefill",
        "",
        f"| model | dtype | turbospec tok/s | HF tok/s | ratio | bound tok/s | bound/ours | {c}-req turbospec tok/s "
        f"| HF seq tok/s | HF batch tok/s | ours/HF seq | ours/HF batch |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        if "summary" not in r:
            lines.append(f"| {r['model']} | {r['dtype']} | failed: {r.get('error', '?')} |||||||||||")
            continue
        s = r["summary"]
        lines.append(
            f"| {r['model']} | {r['dtype']} | {fmt(s['turbospec_tok_s'])} | {fmt(s['hf_tok_s'])} | "
            f"{fmt(s['turbospec_over_hf'], 2)} | {fmt(s['bound_tok_s'])} | {fmt(s['bound_over_turbospec'], 2)} | "
            f"{fmt(s['turbospec_concurrent_tok_s'])} | {fmt(s['hf_sequential_tok_s'])} | {fmt(s['hf_batch_tok_s'])} | "
            f"{fmt(s['turbospec_over_hf_sequential'], 2)} | {fmt(s['turbospec_over_hf_batch'], 2)} |")
    lines += ["", "bound = read bandwidth / weight bytes per decode step (distinct parameters; a tied embedding "
              "counted once, as the LM head reads it; an untied input embedding left out, as only one row per token is "
              "gathered: see bound_all_params_tok_s in the JSON for the plain sum). ratio and ours/HF are turbospec / HF.",
              ""]
    return "\n".join(lines)


def write(report: dict[str, Any], stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.json").write_text(json.dumps(report, indent=1))
    Path(f"{stem}.md").write_text(markdown(report))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="registry models (default: %(default)s)")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--max-tokens", type=int, default=64, help="single-stream output tokens (default 64)")
    ap.add_argument("--prompts", type=int, default=3, help="single-stream prompts to average over (default 3)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in the throughput test (default 16)")
    ap.add_argument("--conc-max-tokens", type=int, default=32, help="output tokens per concurrent request (default 32)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all CPUs)")
    ap.add_argument("--bandwidth-gib", type=float, default=1.0, help="tensor size for the bandwidth test (default 1)")
    ap.add_argument("--prompt-source", default="auto", choices=("auto", "humaneval", "fallback"))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output stem: writes STEM.json and STEM.md")
    args = ap.parse_args(argv)
    for flag in ("max_tokens", "prompts", "concurrency", "conc_max_tokens", "threads"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.max_tokens < 2:
        ap.error("--max-tokens must be >= 2 (decode rate excludes the first token)")
    args.out = Path(str(args.out).removesuffix(".json").removesuffix(".md"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # GGUF de-quantising bars would drown the progress lines
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"metadata": metadata(args), "bandwidth": {}, "results": []}
    log(f"{report['metadata']['cpu_model']}, {args.threads} threads, torch {torch.__version__}")
    report["bandwidth"] = bw = measure_bandwidth(args.bandwidth_gib)
    log(f"read bandwidth {bw['gb_per_s']:.1f} GB/s")
    failed = 0
    t0 = time.perf_counter()
    for name in args.models:
        for dtype in args.dtypes:
            try:
                report["results"].append(bench_one(name, dtype, args, bw))
            except Exception as e:  # keep the other models' numbers
                failed += 1
                log(f"{name} {dtype}: FAILED: {type(e).__name__}: {e}")
                report["results"].append({"model": name, "dtype": dtype, "error": f"{type(e).__name__}: {e}"})
            gc.collect()
            report["metadata"]["elapsed_s"] = time.perf_counter() - t0
            write(report, args.out)  # after every model, so a crash keeps what was measured
    write(report, args.out)
    log(f"wrote {args.out}.json and {args.out}.md in {time.perf_counter() - t0:.0f} s")
    print(markdown(report), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
