"""Batch-invariant execution on CPU: every row of every op is computed the same way whatever else is in the
batch, where the row sits, how its prompt was chunked and how many of its tokens one forward computes.

What breaks invariance here, and the fix for each (measured with torch 2.13 on this machine's CPU; the tests in
tests/determinism/test_determinism.py check each claim):
- ``F.linear`` and matmul pick other kernels for a handful of rows, so a row's result can depend on how many
  rows the call has (seen in ad-hoc probes for small M in fp32); calls whose M is a multiple of 16 agreed.
  So linears, and the rows of attention's matmuls, are padded to a multiple of 16.
- Attention reduces over the context. A matmul whose reduction length changes can assign elements to vector
  lanes differently (a tail loop), so a query's output would depend on the longest context in its group. So
  keys are cut into fixed blocks of ``KEY_BLOCK`` positions: scores and probability-weighted values are
  computed per block with fixed shapes, and blocks are added in a fixed order (a cumulative sum along the
  blocks). Blocks beyond a query's context contribute exact zeros. Queries are padded to a multiple of 16.
- Norms, softmax over one row, rotary embeddings and activations are per-row or elementwise: already
  invariant. The thread count is pinned by the engine config.

Padding costs: a batch-8 decode would pay for 16 rows. But on the machine these notes were written on (AMD
EPYC, torch 2.13, bf16), every weight shape of our models gives a row the same bits for every M >= 2; only
M = 1 takes another kernel for some shapes (large K). On a Xeon with AMX the kernel changes at larger M instead
(33 rows for bf16, 57-193 for fp32), so padding alone is not enough there: calls are capped at a chunk of rows.
``probe_linear`` finds, once per shape and process, the smallest row multiple (1, 2, 4, 8 or 16) and the largest
chunk (256 down to 16 rows) that make a shape invariant, and ``invariant_linear`` pads and splits to those.
The needle tests check the whole engine either way.

On CPUs whose best vector unit is AVX2 (no bf16 arithmetic; `kernels.bf16_rows_invariant`), bf16 linears run
our bf16 kernel (kernels/bf16_rows.cpp) instead: it sums each row in one fixed order whatever the call, so the
linears need neither padding nor chunks there and cost what they cost in the default mode (the mode's remaining
overhead there is attention's: benchmarks/results/determinism_overhead/determinism_overhead_avx2_ours.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels

ROW_MULTIPLE = 16
KEY_BLOCK = 64


def pad_rows(x: torch.Tensor, multiple: int = ROW_MULTIPLE) -> tuple[torch.Tensor, int]:
    """x with zero rows appended so that its first dimension is a multiple of `multiple`; the original count."""
    rows = x.shape[0]
    extra = -rows % multiple
    if extra:
        x = torch.cat([x, x.new_zeros(extra, *x.shape[1:])])
    return x, rows


# Row counts each probe tries: every count up to 64 (kernels switch at odd counts: 33 for bf16 here, 57 for one
# fp32 shape), then a sparse sweep up to the largest chunk.
PROBE_ROWS = (*range(1, 65), 72, 96, 100, 121, 127, 128, 129, 160, 193, 200, 255, 256)
ROW_MULTIPLES = (1, 2, 4, 8, ROW_MULTIPLE)
CHUNK_ROWS = (256, 128, 64, 32, ROW_MULTIPLE)  # largest first: fewer calls for long prefill chunks
_layout: dict[tuple[object, ...], tuple[int, int]] = {}


def probe_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[int, int]:
    """(r, c): the smallest row multiple r (1, 2, 4, 8 or 16), then the largest chunk c, such that F.linear with
    this weight's shape, dtype and device, on this many threads, gives every row the same bits whatever the
    call's row count and the row's place in it, once rows are padded to a multiple of r and calls have at most c
    rows. Probed once per process: row counts in PROBE_ROWS up to c, two random inputs, compared with calls of
    exactly r rows. (16, 16) is the fallback.

    The chunk matters on CPUs whose kernels change with M: on a Xeon with AMX (torch 2.13) bf16 takes another
    kernel from 33 rows and fp32 from 57 to 193 rows depending on the shape, so a row's bits depended on the
    batch until calls were capped at 32 rows there."""
    key = (tuple(weight.shape), weight.dtype, weight.device, bias is not None, torch.get_num_threads())
    if key not in _layout:
        gen = torch.Generator().manual_seed(0)
        inputs = [torch.randn(max(CHUNK_ROWS), weight.shape[1], generator=gen).to(weight.device, weight.dtype)
                  for _ in range(2)]
        _layout[key] = next(((r, c) for r in ROW_MULTIPLES[:-1] for c in CHUNK_ROWS
                             if c % r == 0 and _agrees(weight, bias, inputs, r, c)), (ROW_MULTIPLE, ROW_MULTIPLE))
    return _layout[key]


def _agrees(weight: torch.Tensor, bias: torch.Tensor | None, inputs: list[torch.Tensor], multiple: int,
            chunk: int) -> bool:
    for x in inputs:
        reference = torch.cat([F.linear(x[i:i + multiple], weight, bias) for i in range(0, chunk, multiple)])
        for m in PROBE_ROWS:
            if m > chunk:
                break
            if not torch.equal(F.linear(pad_rows(x[:m], multiple)[0], weight, bias)[:m], reference[:m]):
                return False
    return True


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose rows do not depend on how many other rows the call has: rows padded to the multiple that
    the weight's shape probed at (often 1 or 2, at most 16), in calls of at most the probed chunk of rows."""
    if kernels.bf16_rows_invariant(x, weight, bias):  # AVX2 CPUs: our bf16 kernel, row-independent as it is
        return kernels.bf16_rows_mm(x, weight, bias)
    if x.dim() != 2:
        return invariant_linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    multiple, chunk = probe_linear(weight, bias)
    if x.shape[0] > chunk:
        return torch.cat([invariant_linear(x[i:i + chunk], weight, bias) for i in range(0, x.shape[0], chunk)])
    padded, rows = pad_rows(x, multiple)
    return F.linear(padded, weight, bias)[:rows] if padded.shape[0] != rows else F.linear(x, weight, bias)


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """q [B, Hq, Q, D], k/v [B, Hkv, L, D], mask [B, 1, Q, L] -> [B, Hq, Q, D], such that each query's output
    depends only on its own query, keys and values (see the module docstring). Matmuls run in the input dtype
    as the default path does; the softmax and the sums over blocks in float32."""
    b, hq, nq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    group = hq // hkv
    rows = group * nq  # GQA: the query heads sharing a KV head are rows of one matmul per key block
    row_pad, key_pad = -rows % ROW_MULTIPLE, -length % KEY_BLOCK
    blocks = (length + key_pad) // KEY_BLOCK
    kb = F.pad(k, (0, 0, 0, key_pad)).view(b, hkv, blocks, KEY_BLOCK, d)
    vb = F.pad(v, (0, 0, 0, key_pad)).view(b, hkv, blocks, KEY_BLOCK, d)
    qr = F.pad(q.reshape(b, hkv, 1, rows, d), (0, 0, 0, row_pad))
    scores = torch.matmul(qr, kb.transpose(-1, -2))[..., :rows, :].float() * scale  # [B, Hkv, nb, rows, KB]
    keep = F.pad(mask, (0, key_pad)).view(b, 1, 1, nq, blocks, KEY_BLOCK)  # [B, 1, 1, Q, nb, KB]
    keep = keep.permute(0, 1, 4, 2, 3, 5).expand(b, 1, blocks, group, nq, KEY_BLOCK).reshape(b, 1, blocks, rows,
                                                                                             KEY_BLOCK)
    scores = scores.masked_fill(~keep, float("-inf"))
    top = scores.amax(dim=(2, 4), keepdim=True)  # a max is exact whatever the order
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a padded query row sees no key
    weights = torch.exp(scores - top)  # masked positions: exp(-inf) = 0 exactly
    denom = weights.sum(-1).cumsum(2)[:, :, -1]  # [B, Hkv, rows]: fixed-length sums, then the blocks in order
    weights = F.pad(weights.to(v.dtype), (0, 0, 0, row_pad))
    partial = torch.matmul(weights, vb)[..., :rows, :].float()  # [B, Hkv, nb, rows, D]
    out = partial.cumsum(2)[:, :, -1] / denom.clamp_min(1e-30)[..., None]  # [B, Hkv, rows, D]
    return out.view(b, hq, nq, d).to(q.dtype)


def probe_model(model: torch.nn.Module) -> dict[tuple[int, ...], tuple[int, int] | str]:
    """Probe every linear weight of a model now (an engine that will run the invariant path calls this at
    start-up, so the first invariant step is not the one that pays for it). Returns shape -> (row multiple,
    chunk rows), or "bf16_rows" for weights the mode runs through our kernel: they need no probe (on an AVX2
    CPU the probe of SmolLM2's five shapes took 80 s of a test's start-up, for answers nothing would read)."""
    weights = [(m.weight, m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    embed = getattr(model, "embed", None)
    if isinstance(embed, torch.nn.Embedding):  # tied LM head
        weights.append((embed.weight, None))
    result: dict[tuple[int, ...], tuple[int, int] | str] = {}
    for weight, bias in weights:
        one_row = weight.new_empty(1, weight.shape[1])
        ours = kernels.bf16_rows_invariant(one_row, weight, bias)
        result[tuple(weight.shape)] = "bf16_rows" if ours else probe_linear(weight, bias)
    return result
