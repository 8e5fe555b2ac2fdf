"""HF transformers as a peer row: the same GGUF file dequantised, greedy, one prompt at a time."""

from __future__ import annotations

import time
from typing import Any

from tqdm import tqdm


def load_hf(name: str, dtype: str = "bfloat16") -> Any:
    """The registry model's GGUF file (downloaded once) as an HF causal LM in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    from turbospec.models.registry import pull

    path = pull(name, progress=False)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)).eval()


def hf_generate(model: Any, ids: list[int], max_tokens: int, eos: list[int], **extra: Any) -> tuple[list[int], float]:
    """(the answer's tokens, EOS left out; wall seconds) of one greedy `generate`; `extra` goes to generate
    (assistant_model, prompt_lookup_num_tokens, stopping_criteria, ...)."""
    import torch

    x = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos[0], **extra)
    seconds = time.perf_counter() - start
    return [t for t in gen[0, len(ids):].tolist() if t not in eos], seconds


def hf_run_set(model: Any, prompts: list[list[int]], max_tokens: int, eos: list[int], desc: str = "",
               leave: bool = True, **extra: Any) -> dict[str, Any]:
    """One HF row on one set of prompts, in the shape of harness.turns.set_result (no tau: HF does not say)."""
    outputs, seconds = [], 0.0
    bar = tqdm(prompts, desc=desc, unit="prompt", leave=leave)
    for ids in bar:
        out, took = hf_generate(model, ids, max_tokens, eos, **extra)
        outputs.append(out)
        seconds += took
        bar.set_postfix(tok_s=f"{sum(map(len, outputs)) / seconds:.2f}")
    return {"outputs": outputs, "seconds": seconds, "tokens": sum(map(len, outputs)), "tau": None}
