"""Every registry model against HF transformers loading the same GGUF: float32 logits of a prefill and of
decode steps through the paged KV cache, and greedy tokens through the whole engine."""

from __future__ import annotations

import gc

import pytest
import torch

from turbospec import LLM, SamplingParams
from turbospec.attention import build_metadata
from turbospec.models.registry import REGISTRY, gguf_path, pull

PROMPT = "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n"
DECODE_STEPS = 6
GREEDY_TOKENS = 16
BLOCK = 16


def _hf_reference(name: str, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF greedy continuation and its logits at every position of prompt + continuation."""
    from transformers import AutoModelForCausalLM

    path = gguf_path(name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.inference_mode():
        gen = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                          pad_token_id=0, eos_token_id=None)
        continuation = gen[0, len(prompt_ids):].tolist()
        logits = hf(gen).logits[0].float()
    del hf
    gc.collect()
    return continuation, logits


def _our_logits(llm: LLM, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Prefill the prompt in one chunk, then decode the rest token by token over scattered KV blocks."""
    model = llm.engine.runner.model
    cfg = llm.engine.model_config
    num_blocks = (len(ids) + BLOCK - 1) // BLOCK
    # blocks in reverse order, so a wrong slot computation cannot pass by accident
    slots = (torch.arange(num_blocks).flip(0)[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)
    shape = (num_blocks * BLOCK, cfg.num_kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    rows = []
    with torch.inference_mode():
        meta = build_metadata([prompt_len], [prompt_len], [slots])
        h = model(torch.tensor(ids[:prompt_len]), torch.arange(prompt_len), meta, kv)
        rows.append(model.compute_logits(h[-1:]))
        for pos in range(prompt_len, len(ids)):
            meta = build_metadata([1], [pos + 1], [slots])
            h = model(torch.tensor([ids[pos]]), torch.tensor([pos]), meta, kv)
            rows.append(model.compute_logits(h))
    return torch.cat(rows)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_logits_and_greedy_tokens_match_transformers(name: str) -> None:
    pull(name, progress=False)
    llm = LLM(name, dtype="float32", progress=False, max_model_len=512)
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    ref_tokens, ref_logits = _hf_reference(name, prompt_ids)

    ids = prompt_ids + ref_tokens[:DECODE_STEPS]
    ours = _our_logits(llm, ids, len(prompt_ids))
    expected = ref_logits[len(prompt_ids) - 1: len(prompt_ids) + DECODE_STEPS]
    scale = expected.abs().max().item()
    err = (ours - expected).abs().max().item()
    print(f"{name}: max |logit diff| {err:.2e} over logit scale {scale:.1f}")
    assert err <= 1e-4 * scale, f"{name}: logits differ by {err} (scale {scale})"

    out = llm.generate({"prompt_token_ids": prompt_ids},
                       SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref_tokens
