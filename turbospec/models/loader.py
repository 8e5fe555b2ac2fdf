"""Turn a model argument (registry name, .gguf path, HF safetensors directory, or dummy:<shape>) into a
ready model and tokenizer. GGUF weights are dequantised once and cached as safetensors per dtype, so the
second load of a 1.5B model reads a file instead of decoding for a minute."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..host import (NO_RECORD, file_record_problem, record_path, replace_atomically, turbospec_home,
                    write_file_record, write_text_atomically)
from . import registry
from .gemma3 import Gemma3ForCausalLM
from .gguf_loader import load_gguf
from .layers import dummy_init_
from .llama import CausalLM
from .model_config import DUMMY_SHAPES, ModelConfig, from_hf_config
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from .weight_format import WeightReport, apply_weight_format

log = logging.getLogger("turbospec.loader")

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    source: str
    weights: WeightReport | None = None  # which linears are packed, memory kept (weight_format.py)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of bfloat16, float32, float16")
    return DTYPES[dtype]


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    return Gemma3ForCausalLM if cfg.arch == "gemma3" else CausalLM


def build_meta(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    """Construct on the meta device: shapes only, no memory, no initialisation."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(cfg)(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def build_empty(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    """Construct without initialising, then give it uninitialised storage."""
    return build_meta(cfg, dtype).to_empty(device=device).eval()


def resolve(model: str) -> tuple[str, Path | None]:
    """Classify a model argument: ('registry'|'gguf'|'hf'|'dummy', path)."""
    if model.startswith("dummy:"):
        shape = model.split(":", 1)[1]
        if shape not in DUMMY_SHAPES:
            raise ValueError(f"unknown dummy shape {shape!r}: expected one of {', '.join(sorted(DUMMY_SHAPES))}")
        return "dummy", None
    if model in registry.REGISTRY:
        return "registry", None
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").exists():
        return "hf", path
    if path.exists():
        raise ValueError(f"{model!r} is neither a .gguf file nor a directory with config.json and safetensors")
    raise ValueError(registry.unknown_model_message(model))


def load_model(model: str, dtype: str | torch.dtype = "bfloat16", device: str = "cpu",
               progress: bool = True, weight_format: str = "bf16", requantize: bool = False) -> LoadedModel:
    """Load a model and its tokenizer; see the module docstring for what `model` may be, and
    weight_format.py for `weight_format` (auto, bf16, int4, int8) and `requantize` (4 bits, draft models)."""
    torch_dtype = parse_dtype(dtype)
    kind, path = resolve(model)
    start = time.perf_counter()
    gguf: Path | None = None
    if kind == "dummy":
        cfg = DUMMY_SHAPES[model.split(":", 1)[1]]
        net = build_empty(cfg, torch_dtype, device)
        dummy_init_(net)
        loaded = LoadedModel(cfg, net, ByteTokenizer(cfg.vocab_size), model)
    elif kind == "hf":
        assert path is not None
        loaded = _load_hf_dir(path, torch_dtype, device)
    else:
        gguf = registry.pull(model, progress=progress) if kind == "registry" else path
        assert gguf is not None
        loaded = _load_gguf_cached(gguf, model, torch_dtype, device, progress)
    on_cpu = torch.device(device).type == "cpu"  # the packed kernels are CPU kernels
    loaded.weights = apply_weight_format(loaded.model, gguf if on_cpu else None,
                                         weight_format if on_cpu or weight_format != "auto" else "bf16",
                                         torch_dtype, model, progress, None if gguf is None else _cache_dir(gguf),
                                         requantize)
    log.info("loaded %s (%s, %.1fM params) in %.1fs; %s", model, torch_dtype, loaded.config.num_params() / 1e6,
             time.perf_counter() - start, loaded.weights.line())
    return loaded


def _cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return turbospec_home() / "weights" / f"{gguf.stem}-{key}"


def _load_gguf_cached(gguf: Path, name: str, dtype: torch.dtype, device: str, progress: bool) -> LoadedModel:
    cache = _cache_dir(gguf)
    weights_file = cache / f"model-{str(dtype).removeprefix('torch.')}.safetensors"
    config_file = cache / "config.json"
    loaded = _read_converted(weights_file, config_file, dtype, device) if weights_file.exists() else None
    if loaded is not None:
        cfg, net = loaded
    else:
        cfg, tensors = load_gguf(gguf, name, progress=progress)
        net = build_empty(cfg, dtype, device)
        net.load_weights(tensors)
        # the config first: a reader that finds the weights finds a whole config too
        write_text_atomically(config_file, json.dumps(dataclasses.asdict(cfg)))
        replace_atomically(weights_file, lambda tmp: save_file({k: v.contiguous() for k, v in
                                                                 net.state_dict().items()}, str(tmp)))
        write_file_record(weights_file)
    tok = HFTokenizer.load(gguf.parent, gguf_file=gguf.name, cache_dir=cache / "tokenizer",
                           extra_eos=cfg.eos_token_ids)
    _check_vocab(tok, cfg, name)
    return LoadedModel(cfg, net, tok, name)


def _read_converted(weights_file: Path, config_file: Path, dtype: torch.dtype, device: str
                    ) -> tuple[ModelConfig, CausalLM] | None:
    """The weights converted from the GGUF before, or None (with a line saying why) when they cannot be trusted:
    another size or content than was written, or a file that does not parse. They are then converted again."""
    problem = file_record_problem(weights_file)
    if problem is None or problem == NO_RECORD:  # (no record: converted before records were kept)
        try:
            cfg = ModelConfig(**json.loads(config_file.read_text()))
            cfg = dataclasses.replace(cfg, eos_token_ids=tuple(cfg.eos_token_ids))
        except (OSError, ValueError, TypeError) as exc:
            problem, bad = f"unreadable ({type(exc).__name__}: {exc})", config_file
        else:
            try:
                net = build_meta(cfg, dtype)  # the loaded tensors become the parameters: no second copy in memory
                net.load_state_dict(load_file(weights_file, device=str(device)), strict=True, assign=True)
                net.requires_grad_(False)
                if problem == NO_RECORD:  # whole, as it parsed: the next load checks it quickly
                    write_file_record(weights_file)
                return cfg, net
            except Exception as exc:  # safetensors and torch raise several kinds for a damaged file
                problem, bad = f"unreadable ({type(exc).__name__}: {exc})", weights_file
    else:
        bad = weights_file
    log.warning("cached weights %s: %s; converting them again from the GGUF", bad, problem)
    for stale in (weights_file, config_file, record_path(weights_file)):
        stale.unlink(missing_ok=True)
    return None


def _load_hf_dir(path: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    from safetensors import safe_open

    try:
        cfg = from_hf_config(json.loads((path / "config.json").read_text()), name=str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{path / 'config.json'} cannot be read as a model config: {exc}") from exc
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights")
    net = build_empty(cfg, dtype, device)

    def tensors():
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    t = st.get_tensor(key)
                    # HF Gemma norms hold w for (1 + w); ours do too, so nothing to adjust.
                    yield key.removeprefix("language_model."), t

    net.load_weights(tensors())
    tok = HFTokenizer.load(path, extra_eos=cfg.eos_token_ids)
    _check_vocab(tok, cfg, str(path))
    return LoadedModel(cfg, net, tok, str(path))


def _check_vocab(tok: Tokenizer, cfg: ModelConfig, name: str) -> None:
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"tokenizer of {name} has {tok.vocab_size} tokens but the model's embedding has {cfg.vocab_size}: "
            "they do not belong together"
        )

