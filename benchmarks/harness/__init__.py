"""The benchmark harness: side-by-side rows, one stats source, the provenance header and the results layout.

    from harness import alternating, benchmark_meta, default_out, run_sets, save, stats, warm_up
    llms = {"plain": LLM(model), "eagle": LLM(model, speculative_config=...)}   # loaded together
    for llm in llms.values(): warm_up(llm, first_prompt)
    sets = run_sets(llms, {"mt-bench": [...], "humaneval": [...]}, params)    # turns, order alternating
    stats.tok_s(s["tokens"], s["seconds"]), s["tau"]                          # harness/stats.py computes both
    save(default_out("my_benchmark"), benchmark_meta(threads, model=model), rows, "\n".join(lines))

Scripts import it as `harness` (benchmarks/ is the script's directory, as for `from proposer_zoo import ...`).
"""

from . import stats
from .bandwidth import measure_bandwidth
from .hf import hf_generate, hf_run_set, load_hf
from .machines import CLASSES, machine_class
from .output import RESULTS, Partial, default_out, save, table
from .provenance import benchmark_meta, header_lines
from .turns import alternating, prefill_seconds, run_sets, set_result, warm_up

__all__ = ["CLASSES", "RESULTS", "Partial", "alternating", "benchmark_meta", "default_out", "header_lines",
           "hf_generate", "hf_run_set", "load_hf", "machine_class", "measure_bandwidth", "prefill_seconds", "run_sets", "save",
           "set_result", "stats", "table", "warm_up"]
