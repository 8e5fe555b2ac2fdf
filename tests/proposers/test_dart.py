"""The DART-style parallel draft: one pass equals the base EAGLE layer with its deltas, the n-gram score, the file
(only the deltas, the base checked by hash), training, and exact greedy output through the engine."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from spec_prompts import SPEC_PROMPTS

from turbospec import LLM, SamplingParams
from turbospec.proposers.dart import CONTEXT_WEIGHT, DartConfig, DartDraft, NgramScorer, ngram_table
from turbospec.proposers.dart_proposer import DartProposer
from turbospec.proposers.eagle import EagleDraft
from turbospec.proposers.heads import file_sha256, head_path
from turbospec.training.heads import TrainHeadOptions

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
BASE = head_path(MODEL, "eagle")


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(MODEL, dtype="float32", num_threads=1, max_model_len=512, kv_cache_memory_gib=0.1, progress=False)


def _random_dart(tmp_path: Path, depth: int = 4) -> tuple[DartDraft, Path]:
    """A DART file over a copy of the committed EAGLE draft, with random deltas and masks."""
    base_path = tmp_path / BASE.name
    shutil.copy(BASE, base_path)
    base, _ = EagleDraft.load(base_path)
    cfg = DartConfig(base_path.name, file_sha256(base_path), depth, 8, MODEL, base.config.hidden_size,
                     base.config.vocab_size)
    v = base.vocab
    table = ngram_table(Counter({(5, int(v[0])): 3, (5, int(v[1])): 1, (5, 99999): 7, (6, int(v[2])): 1}), v)
    dart = DartDraft(cfg, base, table)
    for p in dart.lora_b.values():
        p.data.normal_(std=0.02)
    dart.save(tmp_path / "dart.safetensors", {"note": "random"})
    return dart, tmp_path / "dart.safetensors"


def test_one_pass_is_the_base_layer_with_deltas_and_masks_after_the_window(plain, tmp_path):
    """The first output is the adapted layer's output at the window's last entry (masks come after it: causal);
    merging the deltas (what loading does) gives the same outputs; the file holds no base weights."""
    dart, path = _random_dart(tmp_path)
    model = plain.engine.loaded.model
    dart.base.attach(model.embed.weight, model.embed.weight)
    h = dart.config.hidden_size
    states, tokens = torch.randn(2, 5, h), torch.randint(0, 1000, (2, 5))
    out = dart(states, tokens)
    assert out.shape == (2, 4, h)
    reference = EagleDraft.load(tmp_path / BASE.name)[0].attach(model.embed.weight, model.embed.weight)
    with torch.no_grad():
        for key, weight in dart.adapted_weights().items():
            getattr(reference, key.split(".")[0]).weight.copy_(weight)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None].expand(2, -1, -1)
    torch.testing.assert_close(out[:, 0], reference(states, tokens, causal)[0][:, -1], atol=1e-4, rtol=1e-4)
    loaded, extra = DartDraft.load(path)
    loaded.base.attach(model.embed.weight, model.embed.weight)
    assert extra == {"note": "random"} and loaded.merged
    for p in dart.parameters():  # the file stores the deltas and masks in bf16
        p.data = p.data.bfloat16().float()
    out = dart(states, tokens)
    torch.testing.assert_close(loaded(states, tokens), out, atol=1e-4, rtol=1e-4)
    assert path.stat().st_size < BASE.stat().st_size / 4
    # padding on the left (invalid entries) changes nothing for the real ones
    padded = dart(torch.cat([torch.randn(2, 3, h), states], 1), torch.cat([tokens[:, :3], tokens], 1),
                  torch.tensor([[False] * 3 + [True] * 5] * 2))
    torch.testing.assert_close(padded, out, atol=1e-4, rtol=1e-4)


def test_a_changed_or_missing_base_is_refused(tmp_path):
    _, path = _random_dart(tmp_path)
    base = tmp_path / BASE.name
    base.write_bytes(base.read_bytes()[:-1] + b" ")
    with pytest.raises(ValueError, match="is not the EAGLE draft .* was trained on"):
        DartDraft.load(path)
    base.unlink()
    with pytest.raises(ValueError, match="adapts the EAGLE draft .* which is missing"):
        DartDraft.load(path)


def test_a_base_recorded_by_absolute_path_is_found_beside_the_moved_file(tmp_path):
    """Training with --out outside the base's folder records the base's absolute path; once both files move
    together (into heads/), loading finds the base beside the DART file, and still checks its hash."""
    (tmp_path / "trained").mkdir()
    dart, path = _random_dart(tmp_path / "trained")
    dart.config.base = str((tmp_path / "trained" / BASE.name).resolve())
    dart.save(path, {"note": "absolute base"})
    moved = tmp_path / "heads"
    shutil.move(str(tmp_path / "trained"), moved)
    loaded, _ = DartDraft.load(moved / path.name)
    assert loaded.config.base_sha256 == file_sha256(moved / BASE.name)
    (moved / BASE.name).write_bytes((moved / BASE.name).read_bytes()[:-1] + b" ")
    with pytest.raises(ValueError, match="is not the EAGLE draft .* was trained on"):
        DartDraft.load(moved / path.name)


def test_ngram_table_and_score():
    """Successors outside the draft vocabulary or seen once are dropped from the table but count in the total;
    the score is (n + 1/V) / (total + 1) with the request's own pairs counted CONTEXT_WEIGHT times."""
    vocab = torch.tensor([10, 11, 12])
    table = ngram_table(Counter({(1, 10): 5, (1, 11): 1, (1, 99): 4, (2, 12): 2}), vocab)
    assert table["ngram_prev"].tolist() == [1, 2] and table["ngram_next"].tolist() == [10, 12]
    assert dict(zip(table["ngram_total_prev"].tolist(), table["ngram_total"].tolist())) == {1: 10, 2: 2}
    scorer = NgramScorer(table, len(vocab))
    none: Counter = Counter()
    assert scorer.log_prob(1, 10, none, none) == pytest.approx(math.log((5 + 1 / 3) / 11))
    assert scorer.log_prob(1, 11, none, none) == pytest.approx(math.log((1 / 3) / 11))
    assert scorer.log_prob(7, 10, none, none) == pytest.approx(math.log(1 / 3))  # an unseen previous token
    ctx, ctx_totals = Counter({(1, 11): 2}), Counter({1: 2})
    assert scorer.log_prob(1, 11, ctx, ctx_totals) == pytest.approx(
        math.log((2 * CONTEXT_WEIGHT + 1 / 3) / (10 + 2 * CONTEXT_WEIGHT + 1)))


def test_proposer_prefers_the_path_the_ngram_knows(plain, tmp_path):
    """Two candidates the draft finds equally likely at the second position: the one the corpus saw after the
    first position's token wins; the request's own tokens are counted once, then incrementally."""
    dart, _ = _random_dart(tmp_path, depth=2)
    model = plain.engine.loaded.model
    dart.base.attach(model.embed.weight, model.embed.weight)
    proposer = DartProposer(dart, branch=1, beam=1, ngram_weight=1.0)
    engine = plain.engine
    rid = engine.add_request("Hi", SamplingParams(temperature=0, max_tokens=4))
    req = engine.requests[rid]
    v = dart.vocab
    first, second = int(v[0]), int(v[1])
    proposer.observe_hidden(req, torch.randn(1, 3 * dart.config.hidden_size), [7], req.num_tokens)
    proposer._draft_positions = lambda requests, live: setattr(proposer, "position_top", {  # type: ignore
        0: (torch.tensor([[0.0, -9.0], [-1.0, -1.0]]), torch.tensor([[5, int(v[3])], [second, first]]))})
    assert proposer.propose([req], [2])[0].tokens == [5, first]  # (5, v[0]) was seen 3 times, (5, v[1]) never
    pairs, totals, counted = proposer.context[rid]
    ids = list(req.all_token_ids)
    assert counted == len(ids) and pairs == Counter(zip(ids[:-1], ids[1:]))
    req.output_token_ids.extend([first, second, first])  # three more tokens: only the three new pairs are added
    ids = list(req.all_token_ids)
    assert proposer._count_context(req) == Counter(zip(ids[:-1], ids[1:]))
    del req.output_token_ids[-3:]  # taken back without a rollback notice: counted afresh
    ids = list(req.all_token_ids)
    assert proposer._count_context(req) == Counter(zip(ids[:-1], ids[1:])) and proposer.position_top == {}
    with pytest.raises(ValueError, match="grows trees 1 to 2 deep, not 3"):
        DartProposer(dart, depth=3)
    engine.abort_request(rid)


def test_training_pipeline(plain, tmp_path, monkeypatch):
    from turbospec.training.dart import train_dart

    monkeypatch.setenv("TURBOSPEC_HOME", str(tmp_path / "home"))
    opts = TrainHeadOptions("dart", num_heads=3, num_prompts=4, max_tokens=10, budget_minutes=5, epochs=2,
                            batch_size=8, generate_batch=4)
    base = tmp_path / BASE.name
    shutil.copy(BASE, base)
    report = train_dart(plain.engine, opts, tmp_path / "dart.safetensors", base, progress=False)
    assert report["complete"] and report["steps"] > 0 and len(report["heldout_top1_accuracy"]) == 3
    assert report["held_out_unseen_by_base"] is False  # the base learnt from 600 prompts' answers, this run 4
    dart, extra = DartDraft.load(tmp_path / "dart.safetensors")
    assert dart.config.base == BASE.name and dart.config.depth == 3 and extra["ngram_pairs"] > 0
    assert plain.engine.loaded.model.capture_layers == ()
    with pytest.raises(ValueError, match="--method eagle"):
        train_dart(plain.engine, opts, tmp_path / "x.safetensors", tmp_path / "none.safetensors", progress=False)


def test_committed_dart_is_exact_and_accepted(plain):
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(SPEC_PROMPTS, greedy, use_tqdm=False)]
    llm = LLM(MODEL, dtype="float32", num_threads=1, max_model_len=512, kv_cache_memory_gib=0.1, progress=False,
              speculative_config={"method": "dart", "num_speculative_tokens": 8})
    assert isinstance(llm.engine.speculation.proposer, DartProposer)
    got = [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, greedy, use_tqdm=False)]
    assert got == want
    stats = llm.spec_stats()
    # the trained masks add acceptance past the first position: 0.52 / 0.25 / 0.14 here when committed, against
    # 0.54 / 0.17 / 0.20 with the mask offsets zeroed (every mask then starts from the last entry, as the first
    # position does; the n-gram search alone still finds some second tokens). The label arithmetic itself is
    # tested exactly below
    assert stats["mean_accepted_length"] >= 1.5 and stats["acceptance_by_position"][1] >= 0.2, stats
    assert llm.engine.blocks.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("flags, message", [(["--method", "eagle", "--train-sequences", "5"],
                                             "--train-sequences applies to --method dart only"),
                                            (["--method", "eagle", "--base", str(BASE)],
                                             "--base applies to --method dart only"),
                                            (["--method", "dart", "--train-sequences", "-1"],
                                             "--train-sequences must be >= 0"),
                                            (["--method", "dart", "--base", "/nonexistent.safetensors"],
                                             "DART adapts a trained EAGLE draft and /nonexistent.safetensors is "
                                             "missing")])
def test_cli_train_head_dart_flags(flags, message, tmp_path):
    run = subprocess.run([sys.executable, "-m", "turbospec.cli", "train-head", "--model", MODEL, "--num-prompts", "2",
                          "--max-tokens", "4", "--out", str(tmp_path / "x.safetensors"), *flags],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_each_pass_position_is_trained_on_the_targets_choice_that_many_positions_ahead():
    """The label arithmetic, without a model: a stand-in draft whose output j is one-hot at the target's choice
    t + 1 + j scores every hit; labels past a sequence's end are ignored."""
    from types import SimpleNamespace

    from turbospec.training.dart import _batch_loss
    from turbospec.training.eagle import FlatExamples
    from turbospec.training.heads import vocab_remap

    choice = torch.tensor([7, 3, 9, 1, 4, 8, 2, 6, 0, 5, 3, 1])  # two sequences: positions 0-5 and 6-11
    seq_end = torch.tensor([6] * 6 + [12] * 6)
    flat = FlatExamples(torch.arange(12.0)[:, None], torch.zeros(12, dtype=torch.long), choice, [], seq_end)
    depth = 3

    def draft(states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        t = states[:, -1, 0].long()  # the stand-in features carry their own position
        ahead = (t[:, None] + 1 + torch.arange(depth)[None]).clamp(max=11)
        return torch.nn.functional.one_hot(choice[ahead], 10).float() * 20

    dart = type("Stand", (), {"config": SimpleNamespace(depth=depth), "__call__": lambda self, s, k: draft(s, k),
                              "base": SimpleNamespace(fuse=lambda f: f, logits=lambda out: out)})()
    batch = [(1, 0), (2, 0), (7, 6)]  # ends: position 1 has 3 labels, 2 has 3 (5 is the last), 7 has 3
    losses, hits = _batch_loss(dart, flat, batch, 2, vocab_remap(torch.arange(10), 10))
    assert hits.tolist() == [3, 3, 3] and float(losses.max()) < 1e-3
    late = [(4, 0)]  # positions 5, 6, 7 ahead: only 5 is in its sequence
    assert _batch_loss(dart, flat, late, 2, vocab_remap(torch.arange(10), 10))[1].tolist() == [1, 0, 0]
