"""Weight formats: which linears keep a packed low-bit form next to (or instead of) the dense one.

- `bf16`: dense weights in the engine's dtype only (what every earlier version did).
- `int4`: packed only. Q4_0 / Q4_1 / Q4_K tensors run torch's int4 kernel with the file's own groups of 32;
  Q8_0 / Q5_0 / Q6_K tensors run our grouped int8 kernel (their values and group scales held exactly). No dense
  copy of the decoder layers: the least memory, but every call runs packed, prefill too.
- `int8`: packed only, every linear in grouped int8: only files whose linears are all Q8_0 / Q5_0 / Q6_K.
- `auto-q8act`: `auto`, with the packed products' activations quantised to int8 per row and group of 32 inputs
  (scale max|x| / 127) and multiplied by AVX512-VNNI integer dot products (`vpdpbusd`), as llama.cpp's dot products
  do: lossy in the activations (the weights are the file's), cheaper arithmetic for a few rows. Never the default;
  needs AVX512-VNNI and our record kernels, or the AVX2 records path (`vpmaddubsw`; refused elsewhere).
- `auto` (default): where the file's block type can be held exactly, the packed form for calls with up to
  the measured crossover rows (decode, short drafts, verification) and a dense copy for the rest; where our AMX
  GEMM over the packed weights also beats the dense one at prefill sizes (64-256 rows, measured), those run
  packed too, and the dense copy serves the sizes in between and the batch-invariant mode.
  Both are the file's values: the dense copy rounded once to the dtype, the packed form exact for int8 and
  with its int4 group scale and zero rounded to the dtype (exact in float32); on CPUs with AMX our own packed
  forms hold scales in float16 (exact for Q4_0 / Q4_1 / Q8_0 / Q5_0, the K-quants' d * sc rounded at 2^-11).
  So both compute the same model up to that rounding. The packed records run AMX, AVX512-BF16 or, on CPUs with
  only AVX2, float32 FMAs (`kernels/records_avx2.cpp`).

A draft model may also be requantised (`requantize`, speculative_config quantization "int4"): its wider blocks
rounded to 4 bits before packing, lossy for the draft only (its proposals are verified).

A format the file cannot provide exactly is refused (int8 on a Q4_K file, any packed format on safetensors
or dummy weights). The LM head's dense copy is kept in every format: heads and EAGLE read its rows.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from .. import kernels
from ..config import WEIGHT_FORMATS
from ..host import replace_atomically
from . import gguf_blocks
from .crossover import CrossoverCache, cache_path
from .gguf_loader import _unpermute_rope, hf_name, open_reader, read_metadata
from .llama import CausalLM
from .packed import PackedWeight, load_parts, pack, save_parts

log = logging.getLogger("turbospec.weights")

_LINEAR_SUFFIXES = ("attn.qkv.weight", "attn.o.weight", "mlp.gate_up.weight", "mlp.down.weight")


class WeightFormatError(ValueError):
    """The model file cannot provide the requested weight format exactly."""


@dataclass
class WeightReport:
    """What a load kept, for the load log and the benchmarks."""

    format: str
    packed_linears: int = 0
    dense_only_linears: int = 0
    part_kinds: Counter = field(default_factory=Counter)  # e.g. {"int4": 56, "int8": 29}
    packed_bytes: int = 0
    dense_bytes: int = 0  # every dense weight kept (embeddings, norms, dense copies)
    crossover: dict[str, int] = field(default_factory=dict)  # signature -> rows run packed
    prefill_packed: int = 0  # linears whose prefill-sized calls run packed too (crossover.GEMM_ROWS)
    packed_from: set[int] = field(default_factory=set)  # ... from these row counts on
    kept_dense: dict[str, str] = field(default_factory=dict)  # target -> why it has no packed form
    requantized: bool = False  # wider types rounded to 4 bits (a draft model's choice; gguf_blocks.requantize_int4)

    def line(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.part_kinds.items())) or "none"
        rows = sorted(set(self.crossover.values()) - {0})  # 0: left dense, counted as such
        return (f"weight format {self.format}{' (requantised to 4 bits)' if self.requantized else ''}: "
                f"{self.packed_linears} linears packed ({kinds} parts, "
                f"{self.packed_bytes / 2**20:.0f} MiB), {self.dense_only_linears} dense only; dense weights kept "
                f"{self.dense_bytes / 2**20:.0f} MiB; packed for calls of up to {rows} rows"
                + (f" and, for {self.prefill_packed} linears, of {'/'.join(map(str, sorted(self.packed_from)))} rows "
                   "or more" if self.prefill_packed else ""))


Q8_ACT = "auto-q8act"


def _allowed(fmt: str) -> tuple[str, ...]:
    return gguf_blocks.INT8_TYPES if fmt == "int8" else gguf_blocks.INT4_TYPES + gguf_blocks.INT8_TYPES


def _linear_targets(net: CausalLM, reader) -> dict[str, list]:
    """Our linear weight name -> its GGUF tensors in fused-part order."""
    arch = net.cfg.arch
    targets: dict[str, list] = {}
    for t in reader.tensors:
        hf = hf_name(t.name, arch)
        if hf == "model.embed_tokens.weight" and net.lm_head is None:
            target, part = "lm_head.weight", None  # tied: the LM head is the embedding
        else:
            target, part = net._map_name(hf)
        if target is None or not (target.endswith(_LINEAR_SUFFIXES) or target == "lm_head.weight"):
            continue
        slots = targets.setdefault(target, [])
        index = part or 0
        slots.extend([None] * (index + 1 - len(slots)))
        slots[index] = t
    return targets


def _groups(t, net: CausalLM, raw_arch: str) -> gguf_blocks.Groups | None:
    cols, rows = int(t.shape[0]), int(np.prod([int(d) for d in t.shape[1:]]))
    groups = gguf_blocks.decode(t.data, t.tensor_type.name, rows, cols)
    if groups is not None and raw_arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = net.cfg.num_heads if "attn_q" in t.name else net.cfg.num_kv_heads
        groups = groups.take_rows(_unpermute_rope(np.arange(rows), heads))  # the loader's permutation, on row indices
    return groups


def apply_weight_format(net: CausalLM, gguf: Path | None, fmt: str, dtype: torch.dtype, source: str,
                        progress: bool = True, cache_dir: Path | None = None,
                        requantize: bool = False) -> WeightReport:
    """Attach packed forms to `net`'s linears as `fmt` says (see the module docstring); returns what was kept.
    `cache_dir` keeps the packed tensors (packed-<dtype>.safetensors), so later loads skip decoding.
    `requantize` rounds the layers' wider block types to 4 bits first (lossy: draft models only)."""
    if fmt not in WEIGHT_FORMATS:
        raise WeightFormatError(f"unknown weight format {fmt!r}: expected one of {', '.join(WEIGHT_FORMATS)}")
    report = WeightReport(fmt, requantized=requantize)
    if requantize and (gguf is None or fmt not in ("auto", "int4") or dtype not in (torch.bfloat16, torch.float32)):
        raise WeightFormatError(f"requantising to 4 bits needs a GGUF model ({source} is "
                                f"{'not one' if gguf is None else 'one'}), weight format auto or int4 (not {fmt}) "
                                "and dtype bfloat16 or float32")
    if fmt == Q8_ACT and not (dtype == torch.bfloat16 and kernels.records_path() and kernels.q8_records_available()):
        raise WeightFormatError(f"weight format {Q8_ACT} needs dtype bfloat16 (not {str(dtype).removeprefix('torch.')}) "
                                "and a CPU running our record kernels with AVX512-VNNI (AMX or AVX512-BF16) or AVX2; this "
                                "one has " + (f"record kernels {kernels.records_path()!r}" if kernels.records_path()
                                              else "no record kernel") + f", VNNI {kernels.q8_records_available()}: "
                                "use --weight-format auto")
    packing = fmt != "bf16" and gguf is not None and dtype in (torch.bfloat16, torch.float32)
    if fmt in ("int4", "int8") and not packing:
        why = (f"{source} is not a GGUF file" if gguf is None else
               f"packed kernels compute in bfloat16 or float32, not {str(dtype).removeprefix('torch.')}")
        raise WeightFormatError(f"weight format {fmt} needs a GGUF model with quantised tensors: {why}; "
                                "use --weight-format bf16 or auto")
    if packing:
        assert gguf is not None
        _pack_from_gguf(net, gguf, fmt, dtype, report, progress, cache_dir, requantize)
    report.dense_bytes = sum(p.nbytes for p in net.parameters() if p is not None)
    return report


def _decode_all(net: CausalLM, reader, targets: dict[str, list], dtype: torch.dtype,
                progress: bool, requantize: bool) -> dict[str, PackedWeight]:
    raw_arch = read_metadata(reader).get("general.architecture", net.cfg.arch)
    packable = {name: ts for name, ts in targets.items()
                if all(t is not None and gguf_blocks.decodable(t.tensor_type.name) for t in ts)}
    packs = {}
    for name, ts in tqdm(packable.items(), desc="pack weights", unit="linear", disable=not progress, leave=False):
        groups = [_groups(t, net, raw_arch) for t in ts]
        if requantize:
            groups = [gguf_blocks.requantize_int4(g) if isinstance(g, gguf_blocks.Int8Groups) else g for g in groups]
        try:
            if any(g is None for g in groups):
                raise ValueError("a row is not a whole number of blocks")
            packs[name] = pack(groups, dtype)
        except ValueError as exc:  # stays dense (auto); int4 / int8 refuse it
            log.info("%s keeps no packed form: %s", name, exc)
    return packs


def _load_packs(net: CausalLM, gguf: Path, dtype: torch.dtype, progress: bool, cache_dir: Path | None,
                requantize: bool) -> tuple[dict[str, list[str]], dict[str, PackedWeight]]:
    """(our linear -> its GGUF block types, our linear -> packed form for those that have an exact one), from
    the cache file when there is one: opening a GGUF parses its whole vocabulary (14 s for Qwen's)."""
    # torch's int4 layout depends on its version and the CPU's vector width, ours on the records' path (AMX,
    # AVX512-BF16 or AVX2, else none): they name the file
    records = kernels.records_path() if dtype == torch.bfloat16 else ""
    amx = {"amx": "-amx", "dpbf16": "-records-dpbf16", "avx2": "-records-avx2", "": ""}[records]
    tag = f"{str(dtype).removeprefix('torch.')}-{torch.__version__}-{torch.backends.cpu.get_cpu_capability()}{amx}"
    tag += "-requantized4" if requantize else ""
    path = None if cache_dir is None else cache_dir / f"packed-v1-{re.sub(r'[^A-Za-z0-9_.-]', '_', tag)}.safetensors"
    if path is not None and path.exists():
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        tensors = load_file(str(path))
        kinds = json.loads(meta["kinds"])
        return json.loads(meta["types"]), {name: load_parts(k, name, tensors, dtype) for name, k in kinds.items()}
    reader = open_reader(gguf)
    targets = _linear_targets(net, reader)
    types = {name: [t.tensor_type.name if t is not None else "missing" for t in ts] for name, ts in targets.items()}
    packs = _decode_all(net, reader, targets, dtype, progress, requantize)
    if path is not None:
        tensors = {}
        kinds = {name: save_parts(packed, name, tensors) for name, packed in packs.items()}
        metadata = {"kinds": json.dumps(kinds), "types": json.dumps(types)}
        replace_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    return types, packs


def _pack_from_gguf(net: CausalLM, gguf: Path, fmt: str, dtype: torch.dtype, report: WeightReport,
                    progress: bool, cache_dir: Path | None, requantize: bool) -> None:
    types, packs = _load_packs(net, gguf, dtype, progress, cache_dir, requantize)
    allowed = _allowed(fmt)
    dense_only = {name: tys for name, tys in types.items() if name not in packs or any(t not in allowed for t in tys)}
    strict = {name: tys for name, tys in dense_only.items() if name != "lm_head.weight"}  # the head keeps dense anyway
    if strict and fmt in ("int4", "int8"):
        counts = Counter(ty for tys in strict.values() for ty in tys)
        listing = ", ".join(f"{ty} ({n} tensors)" for ty, n in counts.most_common())
        raise WeightFormatError(f"weight format {fmt} needs every linear in {' / '.join(allowed)}; {gguf.name} "
                                f"has {len(strict)} linears holding {listing}: use --weight-format auto (packs what "
                                "it can exactly) or bf16")
    crossover = CrossoverCache(cache_path(dtype))
    for name in types:
        if name in dense_only:
            report.kept_dense[name] = "block types " + "/".join(types[name]) + " have no exact packed form"
            report.dense_only_linears += 1
            continue
        packed = packs[name]
        if fmt == Q8_ACT:
            packed.quantize_activations()
        packed_only = fmt in ("int4", "int8") and name != "lm_head.weight"
        if not packed_only:  # (timing a packed-only linear would also page its unused dense weights in)
            dense = net.get_parameter("embed.weight" if name == "lm_head.weight" and net.lm_head is None else name)
            cross = crossover.get(packed, dense.data)
            packed.max_rows, packed.gemm_rows = cross.max_rows, cross.gemm_rows
            report.crossover[packed.signature] = packed.max_rows
            report.prefill_packed += bool(packed.gemm_rows)
            report.packed_from.update({packed.gemm_rows} - {0})
        if packed.max_rows == 0 and packed.gemm_rows == 0 and not packed_only:  # never faster here: keep the memory
            report.kept_dense[name] = "packed kernel slower than dense at every row count on this machine"
            report.dense_only_linears += 1
            continue
        if name == "lm_head.weight":
            net.lm_head_packed = packed
        else:
            module = net.get_submodule(name.removesuffix(".weight"))
            module.packed = packed
            if packed_only:
                module.weight = None  # type: ignore[assignment]
        report.packed_linears += 1
        report.packed_bytes += packed.nbytes
        report.part_kinds.update(p.kind for p in packed.parts)
    crossover.save()
