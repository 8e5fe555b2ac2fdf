"""`turbospec bench serve` against turbospec's server and llama.cpp's, side by side, on one machine.

Each (server, rate) pair gets a freshly started server, so no run profits from a prefix cache that an earlier
run filled, and one unrelated warm-up request before measuring. Targets:
- turbospec, n-gram speculation chosen by the goodput controller (what `make run` starts);
- turbospec with speculation turned off per request (`"speculation": false`), the same server otherwise;
- llama.cpp through llama-cpp-python's OpenAI server, when `--llamacpp-python` points at a Python that has it
  (REFERENCE.md section 7 says how to build it here), running the same GGUF file. It serves one request at a time;
- llama.cpp's own `llama-server` with `--parallel N` slots and continuous batching, when `--llama-server` points at
  one: the peer a user serving concurrent requests would pick. Build it from the llama-cpp-python sdist's vendored
  sources (no download beyond PyPI):

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/llama-server-build -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build /tmp/llama-server-build --target llama-server -j 2

With `--concurrency 1,4,16` the points are closed loops of that many requests in flight (`bench serve
--request-rate inf --max-concurrency C`) instead of Poisson rates.

    python benchmarks/serve_compare.py --rates 0.5,1,2 --num-prompts 40 --max-tokens 128 \
        --llamacpp-python /tmp/llamacpp-venv/bin/python --output benchmarks/results/serve_compare/serve_compare
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
TURBOSPEC = str(Path(sys.executable).parent / "turbospec")


@dataclass
class Target:
    name: str
    command: list[str]
    extra_body: dict[str, Any] = field(default_factory=dict)
    cwd: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def targets(args: argparse.Namespace, port: int) -> list[Target]:
    serve = [TURBOSPEC, "serve", "--model", args.model, "--port", str(port), "--num-threads", str(args.threads),
             "--speculative-config", json.dumps({"method": "ngram"}), "--log-level", "warning"]
    if args.weight_format:
        serve += ["--weight-format", args.weight_format]
    out = [Target("turbospec (adaptive n-gram)", serve),
           Target("turbospec (no speculation)", serve, {"speculation": False})]
    if args.llamacpp_python:
        from turbospec.models import registry

        gguf = registry.gguf_path(args.model)
        out.append(Target("llama.cpp (llama-cpp-python server)", [
            args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port),
            "--n_threads", str(args.threads), "--n_ctx", "2048",
            # by default a new request interrupts the running one, which then returns a truncated answer
            "--interrupt_requests", "False"], cwd="/tmp"))
    if args.llama_server:
        from turbospec.models import registry

        slots = args.parallel
        out.append(Target(f"llama.cpp (llama-server --parallel {slots})", [
            args.llama_server, "--model", str(registry.gguf_path(args.model)), "--host", "127.0.0.1",
            "--port", str(port), "--threads", str(args.threads), "--parallel", str(slots),
            "--ctx-size", str(2048 * slots)], cwd="/tmp"))  # the context is split between the slots: 2,048 each
    return out


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 1200) -> None:
    """Until the server answers /v1/models. A first start may profile the step time first, which takes minutes on
    a slow 2-core CPU (it outlasted a 5-minute wait on an AMD EPYC Zen 3), hence the long timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready")


def warm_up(url: str) -> None:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0})


def run_one(args: argparse.Namespace, target: Target, rate: str, prefix: Path) -> dict[str, Any]:
    port = int(target.command[target.command.index("--port") + 1])
    url = f"http://127.0.0.1:{port}"
    with open(f"{prefix}.server.log", "w") as log:
        proc = subprocess.Popen(target.command, stdout=log, stderr=subprocess.STDOUT, cwd=target.cwd)
        return _measure(args, target, rate, prefix, url, proc)


def _measure(args: argparse.Namespace, target: Target, rate: str, prefix: Path, url: str,
             proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    try:
        wait_ready(url, proc)
        warm_up(url)
        load = (["--request-rate", "inf", "--max-concurrency", rate] if args.concurrency
                else ["--request-rate", rate])
        bench = [TURBOSPEC, "bench", "serve", "--base-url", url, "--endpoint", "chat", "--dataset", args.dataset,
                 "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens), "--temperature", "0",
                 *load, "--seed", str(args.seed), "--label", target.name,
                 "--output", str(prefix), "--goodput", *args.goodput.split()]
        if target.extra_body:
            bench += ["--extra-body", json.dumps(target.extra_body)]
        subprocess.run(bench, check=False)
        result = json.loads(Path(f"{prefix}.json").read_text())
        if args.concurrency:
            for r in result["rates"]:
                r["max_concurrency"] = int(rate)
        return result
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def load_point(r: dict[str, Any]) -> Any:
    """The x of a point: its concurrency in a closed-loop run, else its request rate."""
    return r.get("max_concurrency", r["request_rate"])


def table(runs: list[dict[str, Any]]) -> list[str]:
    closed = any("max_concurrency" in r for run in runs for r in run["rates"])
    lines = [(f"| server | {'in flight' if closed else 'rate (req/s)'} | completed | failed | out tok/s | TTFT mean (ms) | TTFT p99 | "
              "TPOT mean (ms) | E2EL mean (ms) | E2EL p99 | goodput (req/s) | acceptance |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        for r in run["rates"]:
            spec = (r.get("speculation") or {}).get("turbospec") or {}
            acc = f"{spec['acceptance_rate']:.2f}" if spec.get("acceptance_rate") is not None else "-"
            lines.append(
                f"| {run['label']} | {load_point(r)} | {r['completed']} | {r['failed']} | "
                f"{r['output_throughput']:.1f} | {r['ttft_ms']['mean']:.0f} | {r['ttft_ms']['p99']:.0f} | "
                f"{r['tpot_ms']['mean']:.1f} | {r['e2el_ms']['mean']:.0f} | {r['e2el_ms']['p99']:.0f} | "
                f"{r['request_goodput']:.2f} | {acc} |")
    return lines


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # (the tables are written; `make bench-setup` installs it)
        print(f"note: matplotlib is not installed, {path.name} not drawn (pip install matplotlib)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    by_target: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_target.setdefault(run["label"], []).extend(run["rates"])
    for i, (label, rows) in enumerate(by_target.items()):
        rates, color = [load_point(r) for r in rows], f"C{i}"  # one colour per server in every panel
        axes[0].plot(rates, [r["e2el_ms"]["mean"] / 1000 for r in rows], "o-", color=color, label=f"{label} mean")
        axes[0].plot(rates, [r["e2el_ms"]["p99"] / 1000 for r in rows], "x--", color=color, label=f"{label} p99")
        axes[1].plot(rates, [r["ttft_ms"]["mean"] / 1000 for r in rows], "o-", color=color, label=label)
        axes[2].plot(rates, [r["output_throughput"] for r in rows], "o-", color=color, label=label)
    for ax, title in zip(axes, ("end-to-end latency (s)", "mean time to first token (s)", "output tokens/s")):
        ax.set_xlabel("requests in flight" if any("max_concurrency" in r for run in runs for r in run["rates"])
                      else "request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rates", default="0.5,1,2")
    p.add_argument("--dataset", default="mtbench")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", default="ttft:2000 tpot:100", help="SLOs passed to bench serve")
    p.add_argument("--llamacpp-python", default=None, help="a Python with llama-cpp-python[server] installed")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (built as the docstring says)")
    p.add_argument("--parallel", type=int, default=16, help="llama-server's slots (default %(default)s)")
    p.add_argument("--weight-format", default=None,
                   help="turbospec's --weight-format (default: serve's own, auto; auto-q8act quantises activations "
                        "to int8 as llama.cpp does)")
    p.add_argument("--concurrency", default=None,
                   help="closed-loop points instead of rates: requests in flight, e.g. 1,4,16")
    p.add_argument("--output", default="benchmarks/results/serve_compare/serve_compare")
    p.add_argument("--only", default=None, help="comma-separated target slugs to (re)run, e.g. "
                                                "llama_cpp_llama_cpp_python_server; the summary uses every run on disk")
    p.add_argument("--summarize", action="store_true", help="run nothing: rebuild the summary from the runs on disk")
    args = p.parse_args()
    if args.concurrency:
        if not all(c.isdigit() and int(c) > 0 for c in args.concurrency.split(",")):
            p.error(f"--concurrency takes positive integers separated by commas, got {args.concurrency!r}")
        args.rates = args.concurrency  # the points of the run
    out = Path(args.output)
    work = out.parent / (out.name + "_runs")
    work.mkdir(parents=True, exist_ok=True)
    everything = targets(args, free_port())
    chosen = [] if args.summarize else args.only.split(",") if args.only else [slug(t.name) for t in everything]
    for target in everything:
        if slug(target.name) in chosen:
            for rate in args.rates.split(","):
                run_one(args, target, rate, work / f"{slug(target.name)}_{rate}")
    # the summary takes every target's per-rate files, so one target can be rerun alone (--only)
    runs = []
    for target in everything:
        files = [work / f"{slug(target.name)}_{rate}.json" for rate in args.rates.split(",")]
        if all(f.exists() for f in files):
            parts = [json.loads(f.read_text()) for f in files]
            merged = parts[0]
            merged["rates"] = [r for part in parts for r in part["rates"]]
            for r in merged["rates"]:
                r.pop("requests", None)  # the per-run files keep them
            runs.append(merged)
    from turbospec.bench.machine import machine_info

    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    keep = (args.only or args.summarize) and out.with_suffix(".json").exists()
    previous = json.loads(out.with_suffix(".json").read_text()) if keep else {}
    # with --only, earlier invocations produced the other rows: keep their commands too
    commands = [*previous.get("commands", []), *([] if args.summarize else [command])]
    summary = {"commands": commands, "machine": machine_info(args.threads), "config": vars(args), "runs": runs}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    arrivals = "closed loops of 1..N requests in flight" if args.concurrency else "Poisson arrivals"
    md = [f"# Serving benchmark: {args.model}, {args.dataset} prompts, {arrivals}", "",
          *[f"`{c}`  " for c in commands],
          (f"{summary['machine']['cpu']}, {args.threads} threads, {summary['machine']['date']}, "
           f"commit {summary['machine']['commit']}"), "", *table(runs), ""]
    out.with_suffix(".md").write_text("\n".join(md))
    plot(runs, out.with_suffix(".png"))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
