"""Train Medusa / Hydra heads by self-distillation (``turbospec train-head``), on CPU, resumably.

Recipe (the same for every model, so a committed head file says how to remake it):
1. Prompts: ShareGPT first turns from ``PROMPT_SKIP`` on (benchmarks use the first few hundred, margin-gate and
   the layer search use 5,000 and later), chat template.
2. Answers: the target's own greedy answers (``max_tokens`` each) from our engine, batched. Heads trained on
   the target's own output learn what verification will accept.
3. Features: one forward per prompt + answer gives the target's final hidden state at every answer position
   (kept in RAM, bf16).
4. Training: head i at position t predicts the token at t + 1 + i (Hydra's head i also sees the token at
   t + i); cross-entropy over the draft vocabulary (the answers' most frequent tokens) through the target's
   frozen LM head rows; AdamW, cosine schedule, until the training time budget (answers and features not
   counted) or the epochs run out. 2% of the answers
   are held out to report each head's top-1 accuracy.
Steps 1-3 are cached under ``$TURBOSPEC_HOME/heads/<model>/`` (answers saved every batch, so generation
resumes; hidden states once complete), and training checkpoints there every ``checkpoint_every`` steps;
``--resume`` continues from it.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from ..host import turbospec_home
from ..proposers.heads import DraftHeads, HeadConfig
from ..runner import SeqInput
from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..engine import LLMEngine

PROMPT_SKIP = 1000
IGNORE = -100
DATA_SOURCES = ("answers", "conversations")
FEATURE_METHODS = ("eagle", "dart")  # drafts over the target's fused layer features


@dataclass
class TrainHeadOptions:
    method: str
    num_heads: int = 4
    num_prompts: int = 400
    max_tokens: int = 128
    draft_vocab: int = 8192
    budget_minutes: float = 20.0
    epochs: int = 8
    batch_size: int = 256
    lr: float = 2e-3
    seed: int = 0
    checkpoint_every: int = 50
    generate_batch: int = 16
    # "answers": the target's greedy answers to ShareGPT first turns (generated, slow); "conversations" (EAGLE
    # only): ShareGPT's own answers, teacher-forced, labelled with the target's greedy choice at each position
    # (one forward per conversation: several times more positions per CPU second here)
    data: str = "answers"
    # only ShareGPT first turns whose recorded answer holds a fenced code block (for code models): with
    # "conversations" that recorded answer is read, with "answers" the target answers the prompt itself
    code_only: bool = False
    init: str = ""  # EAGLE: start from this draft file's weights and draft vocabulary (fine-tuning)
    train_sequences: int = 0  # DART: train on the first N training sequences only (0: all); the split is unchanged

    def __post_init__(self) -> None:
        # refused here, not only by the CLI: train_heads() on recorded answers would learn ChatGPT's tokens
        if self.data not in DATA_SOURCES:
            raise ValueError(f"data must be one of {', '.join(DATA_SOURCES)}, got {self.data!r}")
        if self.data == "conversations" and self.method not in FEATURE_METHODS:
            raise ValueError(f"--data conversations trains --method eagle or dart only (the {self.method} heads "
                             "learn from the target's own answers): use --data answers")
        if self.train_sequences < 0:
            raise ValueError(f"--train-sequences must be >= 0 (0: all), got {self.train_sequences}")
        if self.train_sequences and self.method != "dart":
            raise ValueError("--train-sequences applies to --method dart only")
        if self.init and self.method != "eagle":
            raise ValueError("--init applies to --method eagle only (dart adapts its --base)")
        if self.init and not Path(self.init).is_file():  # before the target loads, not after its answers
            raise ValueError(f"--init {self.init}: no such EAGLE file")


def work_dir(model: str) -> Path:
    return turbospec_home() / "heads" / model.replace("/", "_")


CONVERSATIONS_STOP = 5000  # ShareGPT conversations from here on are the margin-gate and layer-search prompts


def distillation_set(engine: LLMEngine, opts: TrainHeadOptions, progress: bool = True
                     ) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, prompt length) per conversation, from `opts.data`."""
    if opts.data == "answers":
        return distillation_answers(engine, opts, progress)
    return conversation_sequences(engine, opts)


def data_description(opts: TrainHeadOptions, count: int) -> str:
    if opts.data == "answers" and opts.code_only:
        return (f"{count} sharegpt[{PROMPT_SKIP}:{CONVERSATIONS_STOP}] first turns whose recorded answer holds a code "
                f"block, the target's greedy answers (at most {opts.max_tokens} tokens each)")
    if opts.data == "answers":
        return f"sharegpt[{PROMPT_SKIP}:{PROMPT_SKIP + count}] first turns, the target's greedy answers"
    return (f"{count} sharegpt[{PROMPT_SKIP}:{CONVERSATIONS_STOP}] first turns with their recorded answers"
            f"{' holding a code block' if opts.code_only else ''} (at most {opts.max_tokens} tokens each), "
            "teacher-forced; labels are the target's greedy choices")


def conversation_sequences(engine: LLMEngine, opts: TrainHeadOptions) -> list[tuple[list[int], int]]:
    """ShareGPT first turns with the answers recorded in the data set, cut to `max_tokens` answer tokens: the
    target reads them teacher-forced, and what it would have chosen at each position is the label."""
    from ..data.prompts import load_sharegpt_exchanges

    pairs = load_sharegpt_exchanges(opts.num_prompts, PROMPT_SKIP, CONVERSATIONS_STOP, max_chars=1500,
                                    code_only=opts.code_only)
    if len(pairs) < opts.num_prompts:
        raise ValueError(f"only {len(pairs)} ShareGPT conversations in [{PROMPT_SKIP}, {CONVERSATIONS_STOP}) match "
                         f"(code_only={opts.code_only}); ask for at most that many")
    tok = engine.tokenizer
    out = []
    for prompt, answer in pairs:
        ids = (tok.apply_chat_template([{"role": "user", "content": prompt}])
               if getattr(tok, "has_chat_template", False) else tok.encode(prompt))
        out.append((ids + tok.encode(answer, add_special_tokens=False)[: opts.max_tokens], len(ids)))
    return out


def distillation_answers(engine: LLMEngine, opts: TrainHeadOptions, progress: bool = True
                         ) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, prompt length) per prompt; cached and resumable."""
    from ..data.prompts import load_sharegpt, load_sharegpt_exchanges

    code = "-code" if opts.code_only else ""
    path = work_dir(engine.config.model) / f"answers-{PROMPT_SKIP}-{opts.max_tokens}{code}.jsonl"
    done: list[tuple[list[int], int]] = []
    if path.exists():
        done = [tuple(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]  # type: ignore[misc]
    if len(done) >= opts.num_prompts:
        return done[: opts.num_prompts]
    if opts.code_only:
        texts = [prompt for prompt, _ in load_sharegpt_exchanges(opts.num_prompts, PROMPT_SKIP, CONVERSATIONS_STOP,
                                                                 max_chars=1500, code_only=True)]
    else:
        texts = [p.text for p in load_sharegpt(opts.num_prompts, max_chars=1500, skip=PROMPT_SKIP)]
    tok = engine.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": t}]) if getattr(tok, "has_chat_template", False)
           else tok.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=opts.max_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(ids), initial=len(done), desc="target answers", unit="prompt", disable=not progress)
    with path.open("a") as f:
        for start in range(len(done), len(ids), opts.generate_batch):
            batch = ids[start: start + opts.generate_batch]
            rids = [engine.add_request(p, params, request_id=f"distill-{start + j}") for j, p in enumerate(batch)]
            outs = {}
            while engine.has_unfinished_requests():
                outs.update({o.request_id: o for o in engine.step() if o.finished})
            for rid, p in zip(rids, batch):
                row = (p + outs[rid].outputs[0].token_ids, len(p))
                done.append(row)
                f.write(json.dumps(row) + "\n")
            f.flush()
            bar.update(len(batch))
    bar.close()
    return done


@torch.inference_mode()
def hidden_states(engine: LLMEngine, sequences: list[tuple[list[int], int]], progress: bool = True
                  ) -> list[torch.Tensor]:
    """The target's final hidden state at positions plen-1 .. len-2 of each sequence (those whose LM head
    output is an answer token), [len - plen, H] bf16 each."""
    out = []
    for i, (ids, plen) in enumerate(tqdm(sequences, desc="hidden states", unit="seq", disable=not progress)):
        rid = f"features-{i}"
        engine.blocks.allocate(rid, ids, len(ids) - 1)
        try:
            out.append(engine.runner.run([SeqInput(rid, ids[:-1], 0, len(ids) - plen)]).hidden.to(torch.bfloat16))
        finally:
            engine.blocks.free(rid)
    return out


def draft_vocabulary(sequences: list[tuple[list[int], int]], size: int) -> torch.Tensor:
    counts = Counter(t for ids, plen in sequences for t in ids[plen:])
    return torch.tensor(sorted(t for t, _ in counts.most_common(size)))


def _examples(sequences: list[tuple[list[int], int]], hidden: list[torch.Tensor], num_heads: int,
              remap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat training rows: hidden [N, H], the previous token per head [N, K] (Hydra's input: token at t + i),
    and the label per head [N, K] (draft-vocabulary index of the token at t + 1 + i, or IGNORE)."""
    hs, prevs, labels = [], [], []
    for (ids, plen), h in zip(sequences, hidden):
        seq = torch.tensor(ids)
        n = len(ids) - plen  # rows: positions t = plen-1 .. len-2
        t = torch.arange(plen - 1, len(ids) - 1)
        prev = torch.full((n, num_heads), 0, dtype=torch.long)
        lab = torch.full((n, num_heads), IGNORE, dtype=torch.long)
        for i in range(1, num_heads + 1):
            ok = t + 1 + i < len(ids)
            prev[:, i - 1] = seq[(t + i).clamp(max=len(ids) - 1)]
            mapped = remap[seq[(t + 1 + i).clamp(max=len(ids) - 1)]]
            lab[:, i - 1] = torch.where(ok & (mapped >= 0), mapped, torch.full_like(mapped, IGNORE))
        hs.append(h)
        prevs.append(prev)
        labels.append(lab)
    return torch.cat(hs), torch.cat(prevs), torch.cat(labels)


def head_loss(heads: DraftHeads, h: torch.Tensor, prev: torch.Tensor, labels: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over heads and rows with a label, and per-head top-1 hits [K] (no grad)."""
    z = h
    losses = []
    hits = []
    for i in range(heads.config.num_heads):
        z = heads.step(i, z, h, prev[:, i])
        logits = heads.logits(z)
        losses.append(F.cross_entropy(logits, labels[:, i], ignore_index=IGNORE, reduction="sum"))
        with torch.no_grad():
            valid = labels[:, i] != IGNORE
            hits.append(((logits.argmax(-1) == labels[:, i]) & valid).sum())
    count = (labels != IGNORE).sum().clamp(min=1)
    return torch.stack(losses).sum() / count, torch.stack(hits)


@dataclass
class Split:
    """The answered prompts, 2% held out, and the draft vocabulary of the training answers."""

    train: list[tuple[list[int], int]]
    held_out: list[tuple[list[int], int]]
    vocab: torch.Tensor  # target token ids
    remap: torch.Tensor  # [V]: index in vocab, or -1


def split_answers(engine: LLMEngine, opts: TrainHeadOptions, progress: bool) -> Split:
    sequences = distillation_set(engine, opts, progress)
    order = list(range(len(sequences)))
    random.Random(opts.seed).shuffle(order)
    held = max(1, len(order) // 50)
    train = [sequences[i] for i in order[held:]]
    vocab = draft_vocabulary(train, opts.draft_vocab)
    return Split(train, [sequences[i] for i in order[:held]], vocab, vocab_remap(vocab, engine.model_config.vocab_size))


def vocab_remap(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V]: each target token's index in the draft vocabulary, -1 outside it (the labels' mapping)."""
    remap = torch.full((vocab_size,), -1, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    return remap


def cached(path: Path, compute: Callable[[], Any]) -> Any:
    """torch.load(path), or compute() saved there (features another head method reuses)."""
    if path.exists():
        return torch.load(path)
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(value, path)
    return value


def train_loop(module: nn.Module, opts: TrainHeadOptions, num_examples: int, ckpt: Path, resume: bool,
               loss_of: Callable[[list[int], int], torch.Tensor], desc: str, progress: bool
               ) -> tuple[int, int, list[float], float]:
    """AdamW with a cosine schedule (lr to lr / 20) over shuffled batches of example indices, until the epochs or
    the training time budget run out; checkpoints every `checkpoint_every` steps and resumes from them.
    loss_of(batch, step) gives a batch's loss. Returns (steps done, total steps, losses, seconds)."""
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=opts.lr, weight_decay=0.0)
    steps_per_epoch = max(1, num_examples // opts.batch_size)
    total_steps = steps_per_epoch * opts.epochs
    step = 0
    if resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        module.load_state_dict(state["module"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    budget_s = opts.budget_minutes * 60  # training time: answers and features are cached
    started = time.perf_counter()
    gen = torch.Generator().manual_seed(opts.seed)
    bar = tqdm(total=total_steps, initial=step, desc=desc, unit="step", disable=not progress)
    losses: list[float] = []
    module.train()
    with torch.enable_grad():
        while step < total_steps and time.perf_counter() - started < budget_s:
            perm = torch.randperm(num_examples, generator=gen).tolist()
            for b in range(steps_per_epoch):
                if step >= total_steps or time.perf_counter() - started >= budget_s:
                    break
                for group in opt.param_groups:
                    group["lr"] = opts.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * step / total_steps)))
                loss = loss_of(perm[b * opts.batch_size: (b + 1) * opts.batch_size], step)
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                losses.append(float(loss.detach()))
                bar.update(1)
                bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
                if step % opts.checkpoint_every == 0:
                    ckpt.parent.mkdir(parents=True, exist_ok=True)
                    torch.save({"module": module.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
    bar.close()
    module.eval()
    return step, total_steps, losses, time.perf_counter() - started


def train_heads(engine: LLMEngine, opts: TrainHeadOptions, out_path: Path, resume: bool = False,
                progress: bool = True) -> dict[str, object]:
    torch.manual_seed(opts.seed)
    started = time.perf_counter()
    split = split_answers(engine, opts, progress)
    n_seqs = len(split.train) + len(split.held_out)
    hidden = cached(work_dir(engine.config.model) / f"hidden-{PROMPT_SKIP}-{opts.max_tokens}-{n_seqs}-{opts.seed}.pt",
                    lambda: hidden_states(engine, split.train + split.held_out, progress))
    h_train, p_train, y_train = _examples(split.train, hidden[: len(split.train)], opts.num_heads, split.remap)
    h_eval, p_eval, y_eval = _examples(split.held_out, hidden[len(split.train):], opts.num_heads, split.remap)

    cfg = engine.model_config
    config = HeadConfig(opts.method, opts.num_heads, cfg.hidden_size, max(16, cfg.hidden_size // 4),
                        engine.config.model, cfg.vocab_size)
    model = engine.loaded.model
    heads = DraftHeads(config, split.vocab)
    heads.attach(model.lm_head_weight.float(), model.embed.weight.float())  # trained in float32

    def loss_of(batch: list[int], step: int) -> torch.Tensor:
        idx = torch.tensor(batch)
        return head_loss(heads, h_train[idx].float(), p_train[idx], y_train[idx])[0]

    step, total_steps, losses, train_s = train_loop(
        heads, opts, len(h_train), work_dir(engine.config.model) / f"checkpoint-{opts.method}.pt", resume, loss_of,
        f"training {opts.method} heads", progress)
    heads.eval()
    with torch.no_grad():
        _, hits = head_loss(heads, h_eval.float(), p_eval, y_eval)
        valid = (y_eval != IGNORE).sum(0).clamp(min=1)
        accuracy = (hits.float() / valid.float()).tolist()
        # how often the target's own token is in the draft vocabulary at all (a cap on every head's accuracy)
        coverage = float((y_eval[:, 0] != IGNORE).float().mean())
    report = {
        "options": asdict(opts), "steps": step, "total_steps": total_steps,
        "final_loss": losses[-1] if losses else None,
        "heldout_top1_accuracy": [round(a, 4) for a in accuracy], "draft_vocab_coverage": round(coverage, 4),
        "train_positions": len(h_train), "eval_positions": len(h_eval), "prompts": n_seqs,
        "seconds": round(time.perf_counter() - started, 1), "train_seconds": round(train_s, 1),
        "data": data_description(opts, n_seqs), "complete": step >= total_steps,
    }
    heads.save(out_path, report)
    return report
