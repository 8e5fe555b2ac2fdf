"""Medusa / Hydra heads: the file format and the frozen LM head, the training pipeline (cached answers, resumable
checkpoints), the tree the proposer grows, and the committed heads: exact greedy output with real acceptance."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spec_prompts import SPEC_PROMPTS

from turbospec import LLM, SamplingParams
from turbospec.bench.eagle_reference import RecomputingEagleProposer
from turbospec.proposers.eagle import EagleConfig, EagleDraft, default_feature_layers
from turbospec.proposers.head_proposer import EagleProposer, HeadProposer, TreeDrafter
from turbospec.proposers.heads import HEADS_DIR, DraftHeads, HeadConfig, head_path
from turbospec.training.heads import TrainHeadOptions, train_heads, work_dir

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(MODEL, dtype="float32", num_threads=1, max_model_len=512, kv_cache_memory_gib=0.1, progress=False)


def test_untrained_medusa_head_is_the_lm_head_on_the_draft_vocabulary(plain, tmp_path):
    """W2 starts at zero, so every head's logits are the target's own logits on the draft vocabulary; saving and
    loading keeps the weights and the vocabulary."""
    model = plain.engine.loaded.model
    cfg = plain.engine.model_config
    vocab = torch.tensor([3, 17, 198, 1000, 4000, 30000])
    heads = DraftHeads(HeadConfig("medusa", 2, cfg.hidden_size, 32, MODEL, cfg.vocab_size), vocab)
    heads.attach(model.embed.weight, model.embed.weight)
    h = torch.randn(5, cfg.hidden_size)
    want = model.compute_logits(h)[:, vocab]
    for i in range(2):
        torch.testing.assert_close(heads.logits(heads.step(i, h, h, None)), want)
    heads.w2[1].weight.data.normal_()
    heads.save(tmp_path / "h.safetensors", {"note": "x"})
    loaded, extra = DraftHeads.load(tmp_path / "h.safetensors")
    assert extra == {"note": "x"} and torch.equal(loaded.vocab, vocab)
    assert torch.equal(loaded.w2[1].weight, heads.w2[1].weight.to(torch.bfloat16).float())
    assert set(loaded.state_dict()) == {f"w{j}.{i}.{p}" for j in (1, 2) for i in range(2) for p in ("weight", "bias")}


def test_eagle_training_pipeline(plain, tmp_path, monkeypatch):
    from turbospec.training.eagle import train_eagle

    monkeypatch.setenv("TURBOSPEC_HOME", str(tmp_path / "home"))
    opts = TrainHeadOptions("eagle", num_heads=2, num_prompts=4, max_tokens=10, draft_vocab=256, budget_minutes=5,
                            epochs=2, batch_size=8, generate_batch=4)
    report = train_eagle(plain.engine, opts, tmp_path / "eagle.safetensors", progress=False)
    assert report["complete"] and report["steps"] > 0 and report["feature_layers"] == default_feature_layers(30)
    draft, extra = EagleDraft.load(tmp_path / "eagle.safetensors")
    assert draft.config.depth == 2 and draft.config.window == 16 and extra["prompts"] == 4
    assert plain.engine.loaded.model.capture_layers == ()  # features were captured only while collecting them

    # fine-tuning it (--init) on the target's own answers to code prompts: same vocabulary, new weights, and the
    # starting point's score on the new held-out set is reported next to the result's
    from turbospec.data.prompts import load_sharegpt_exchanges
    from turbospec.proposers.heads import file_sha256
    from turbospec.training.heads import CONVERSATIONS_STOP, PROMPT_SKIP, distillation_answers

    tuned_opts = TrainHeadOptions("eagle", num_heads=2, num_prompts=3, max_tokens=10, budget_minutes=5, epochs=1,
                                  batch_size=8, generate_batch=3, code_only=True,
                                  init=str(tmp_path / "eagle.safetensors"))
    tuned_report = train_eagle(plain.engine, tuned_opts, tmp_path / "tuned.safetensors", progress=False)
    tuned, tuned_extra = EagleDraft.load(tmp_path / "tuned.safetensors")
    assert torch.equal(tuned.vocab, draft.vocab) and not torch.equal(tuned.qkv.weight, draft.qkv.weight)
    assert tuned_extra["init"] == tuned_report["init"]
    assert tuned_report["init"]["sha256"] == file_sha256(tmp_path / "eagle.safetensors")
    assert len(tuned_report["init"]["heldout_top1_accuracy"]) == 2
    prompts = [p for p, _ in load_sharegpt_exchanges(3, PROMPT_SKIP, CONVERSATIONS_STOP, max_chars=1500,
                                                     code_only=True)]
    tok = plain.engine.tokenizer
    answered = distillation_answers(plain.engine, tuned_opts, progress=False)  # cached: the same sequences
    assert [ids[:plen] for ids, plen in answered] == [tok.apply_chat_template([{"role": "user", "content": p}])
                                                      for p in prompts]
    assert (work_dir(MODEL) / f"answers-{PROMPT_SKIP}-10-code.jsonl").exists()
    with pytest.raises(ValueError, match="trained for smollm2-135m .*depth 2.*needs smollm2-135m .*, 16, 3"):
        train_eagle(plain.engine, TrainHeadOptions("eagle", num_heads=3, num_prompts=3, max_tokens=10, code_only=True,
                                                   init=str(tmp_path / "eagle.safetensors")), tmp_path / "x", False)


def test_eagle_conversation_labels_are_the_targets_greedy_choices(plain, tmp_path, monkeypatch):
    """--data conversations: ShareGPT's recorded answers read teacher-forced; each position's label is what the
    target itself would generate next there (checked against generate() on that prefix), not the data's token."""
    from turbospec.data.prompts import load_sharegpt_exchanges
    from turbospec.training.eagle import target_features
    from turbospec.training.heads import CONVERSATIONS_STOP, PROMPT_SKIP, conversation_sequences

    monkeypatch.setenv("TURBOSPEC_HOME", str(tmp_path / "home"))
    opts = TrainHeadOptions("eagle", num_prompts=2, max_tokens=12, data="conversations", code_only=True)
    sequences = conversation_sequences(plain.engine, opts)
    assert len(sequences) == 2 and all(len(ids) - plen == 12 for ids, plen in sequences)
    pairs = load_sharegpt_exchanges(2, PROMPT_SKIP, CONVERSATIONS_STOP, max_chars=1500, code_only=True)
    tok = plain.engine.tokenizer
    for (prompt, answer), (ids, plen) in zip(pairs, sequences):
        assert "```" in answer and ids[plen:] == tok.encode(answer, add_special_tokens=False)[:12]
        assert ids[:plen] == tok.apply_chat_template([{"role": "user", "content": prompt}])
    (ids, plen), = sequences[:1]
    feats, first, choices = target_features(plain.engine, [(ids, plen)], [6, 14], 4, progress=False)[0]
    assert first == plen - 5 and feats.shape[0] == choices.shape[0] == len(ids) - 1 - first
    for j in (plen - 1, plen + 3, len(ids) - 2):  # position j's label: the target's greedy token after ids[:j + 1]
        want = plain.generate({"prompt_token_ids": ids[: j + 1]}, SamplingParams(temperature=0, max_tokens=1),
                              use_tqdm=False)[0].outputs[0].token_ids[0]
        assert int(choices[j - first]) == want


def test_conversations_and_init_are_refused_for_heads():
    with pytest.raises(ValueError, match="--data conversations trains --method eagle or dart only"):
        TrainHeadOptions("medusa", data="conversations")  # the library refuses it too, not only the CLI
    with pytest.raises(ValueError, match="data must be one of answers, conversations"):
        TrainHeadOptions("eagle", data="chats")
    for flags, message in ((["--method", "hydra", "--data", "conversations"], "--data conversations trains --method "
                            "eagle or dart only"), (["--method", "hydra", "--init", "x"], "--init applies to --method "
                                            "eagle only"), (["--method", "eagle", "--init", "missing.safetensors"],
                                                            "--init missing.safetensors: no such EAGLE file")):
        run = subprocess.run([sys.executable, "-m", "turbospec.cli", "train-head", "--model", MODEL, *flags],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 2 and message in run.stderr, run.stderr


def test_training_pipeline_caches_answers_and_resumes(plain, tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOSPEC_HOME", str(tmp_path / "home"))
    opts = TrainHeadOptions("hydra", num_heads=2, num_prompts=6, max_tokens=12, draft_vocab=512, budget_minutes=5,
                            epochs=3, batch_size=16, checkpoint_every=2, generate_batch=4)
    out = tmp_path / "hydra.safetensors"
    report = train_heads(plain.engine, opts, out, progress=False)
    answers = list(work_dir(MODEL).glob("answers-*.jsonl"))
    assert len(answers) == 1 and len(answers[0].read_text().splitlines()) == 6
    assert report["complete"] and report["steps"] == report["total_steps"] > 0
    assert report["prompts"] == 6 and 0 <= min(report["heldout_top1_accuracy"]) <= 1
    heads, extra = DraftHeads.load(out)
    assert heads.config.method == "hydra" and heads.config.num_heads == 2 and len(heads.vocab) <= 512
    assert extra["data"].startswith("sharegpt[1000:1006]")
    assert not plain.engine.has_unfinished_requests()
    assert (work_dir(MODEL) / "checkpoint-hydra.pt").exists()
    # a second run reuses the answers (no generation) and, resumed, starts from the checkpoint's step
    monkeypatch.setattr(plain.engine, "add_request", lambda *a, **k: pytest.fail("answers were regenerated"))
    again = train_heads(plain.engine, opts, out, resume=True, progress=False)
    assert again["steps"] == again["total_steps"]


def test_proposer_grows_prefix_closed_trees_and_chains_for_deterministic_requests(plain):
    model = plain.engine.loaded.model
    cfg = plain.engine.model_config
    heads = DraftHeads(HeadConfig("hydra", 3, cfg.hidden_size, 32, MODEL, cfg.vocab_size), torch.arange(2000))
    for w in heads.w2:
        w.weight.data.normal_(std=0.05)
    heads.attach(model.embed.weight, model.embed.weight)
    proposer = HeadProposer(heads, branch=3, beam=3)
    engine = plain.engine
    rid = engine.add_request("Hello there", SamplingParams(temperature=0, max_tokens=4))
    req = engine.requests[rid]
    proposer.observe_hidden(req, torch.randn(1, cfg.hidden_size), [1], req.num_tokens)
    draft = proposer.propose([req], [7])[0]
    assert draft.tree is not None and len(draft.tree) == 7 and draft.tokens == draft.tree.tokens
    assert max(draft.tree.depth) <= 3 and draft.tree.parents.count(-1) >= 2
    assert all(t < 2000 for t in draft.tokens)  # draft vocabulary only
    proposer.observe_hidden(req, torch.randn(1, cfg.hidden_size), [1], req.num_tokens + 1)  # stale: no draft
    assert proposer.propose([req], [7])[0].tokens == []
    req.determinism = "batch-invariant"
    proposer.observe_hidden(req, torch.randn(1, cfg.hidden_size), [1], req.num_tokens)
    chain = proposer.propose([req], [7])[0]
    assert chain.tree is None and len(chain.tokens) == 3  # one path, as deep as the heads go
    engine.abort_request(rid)


def test_eagle_draft_appending_entries_equals_recomputing_the_window(plain):
    """Outputs for entries appended with `past` keys / values equal one causal pass over all entries."""
    cfg = plain.engine.model_config
    model = plain.engine.loaded.model
    layers = default_feature_layers(cfg.num_layers)
    draft = EagleDraft(EagleConfig(cfg.hidden_size, layers, 32, 128, 64, 16, 3, MODEL, cfg.vocab_size),
                       torch.arange(500))
    for p in draft.parameters():
        p.data.normal_(std=0.05)
    draft.attach(model.embed.weight, model.embed.weight)
    states, tokens = torch.randn(2, 7, cfg.hidden_size), torch.randint(0, 500, (2, 7))
    causal = torch.ones(7, 7, dtype=torch.bool).tril()[None].expand(2, -1, -1)
    whole, _ = draft(states, tokens, causal)
    first, past = draft(states[:, :5], tokens[:, :5], causal[:, :5, :5])
    rest, _ = draft(states[:, 5:], tokens[:, 5:], causal[:, 5:, :], past)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), whole, atol=1e-5, rtol=1e-5)
    assert draft.fuse(torch.randn(3, (len(layers) + 1) * cfg.hidden_size)).shape == (3, cfg.hidden_size)


def test_eagle_proposer_computes_each_tree_entry_once_and_grows_the_recomputed_trees(plain):
    """Deeper levels attend to the window's and the ancestors' kept keys and values: the trees (two requests
    with windows of different lengths, so the kept keys are padded) are those of recomputing every path."""
    cfg = plain.engine.model_config
    model = plain.engine.loaded.model
    draft = EagleDraft(EagleConfig(cfg.hidden_size, [3, 7], 32, 128, 64, 16, 4, MODEL, cfg.vocab_size),
                       torch.arange(1000))
    for p in draft.parameters():
        p.data.normal_(std=0.05)
    draft.attach(model.embed.weight, model.embed.weight)
    engine = plain.engine
    requests = [engine.requests[engine.add_request(p, SamplingParams(temperature=0, max_tokens=4))]
                for p in ("Hi", "Hello there")]
    proposers = [EagleProposer(draft, branch=2, beam=2), RecomputingEagleProposer(draft, branch=2, beam=2)]
    gen = torch.Generator().manual_seed(0)
    for req, entries in zip(requests, (3, 9)):
        feats = torch.randn(entries, 3 * cfg.hidden_size, generator=gen)
        for proposer in proposers:
            proposer.observe_hidden(req, feats, list(range(10, 10 + entries)), req.num_tokens)
    outputs: list[list[torch.Tensor]] = []  # the layer's outputs each proposer scored, level by level
    logits = draft.logits
    draft.logits = lambda out: (outputs[-1].append(out), logits(out))[1]  # type: ignore[method-assign]
    ours, reference = [], []
    for proposer, drafts in zip(proposers, (ours, reference)):
        outputs.append([])
        drafts.extend(proposer.propose(requests, [12, 7]))
    torch.testing.assert_close(torch.cat(outputs[0]), torch.cat(outputs[1]), atol=1e-5, rtol=1e-5)
    for a, b in zip(ours, reference):
        assert a.tree is not None and b.tree is not None and max(a.tree.depth) >= 3  # nodes over ancestors
        assert (a.tokens, a.tree.parents, a.tree.ranks) == (b.tokens, b.tree.parents, b.tree.ranks)
    for req in requests:
        engine.abort_request(req.request_id)


def test_eagle_proposer_keeps_a_window_of_the_emitted_tokens_features(plain):
    cfg = plain.engine.model_config
    model = plain.engine.loaded.model
    draft = EagleDraft(EagleConfig(cfg.hidden_size, [3, 7], 32, 128, 64, 4, 3, MODEL, cfg.vocab_size),
                       torch.arange(1000)).attach(model.embed.weight, model.embed.weight)
    proposer = EagleProposer(draft, branch=2, beam=2)
    assert proposer.capture_layers == (3, 7)
    engine = plain.engine
    rid = engine.add_request("Hi", SamplingParams(temperature=0, max_tokens=4))
    req = engine.requests[rid]
    feats = torch.randn(6, 3 * cfg.hidden_size)
    proposer.observe_hidden(req, feats[:1], [11], req.num_tokens - 5)  # after the prompt: one entry
    proposer.observe_hidden(req, feats[1:], [12, 13, 14, 15, 16], req.num_tokens)  # five more: the window keeps 4
    assert [t for _, t in proposer.window[rid]] == [13, 14, 15, 16]
    assert proposer.unfused[rid] == 4  # kept as features until the request drafts
    [window] = proposer.windows([rid])
    torch.testing.assert_close(torch.stack([state for state, _ in window]), draft.fuse(feats[2:]))
    assert proposer.unfused[rid] == 0
    draft_out = proposer.propose([req], [5])[0]
    assert draft_out.tree is not None and len(draft_out.tree) == 5 and max(draft_out.tree.depth) <= 3
    proposer.observe_hidden(req, feats[:1], [17], req.num_tokens + 1)  # one more: only it is fused next time
    [window] = proposer.windows([rid])
    torch.testing.assert_close(torch.stack([state for state, _ in window]), draft.fuse(feats[[3, 4, 5, 0]]))
    proposer.observe_hidden(req, feats[:2], [1, 2], req.num_tokens + 7)  # a gap: the window starts afresh
    assert [t for _, t in proposer.window[rid]] == [1, 2] and proposer.unfused[rid] == 2
    engine.abort_request(rid)


@pytest.mark.parametrize("method", ["medusa", "hydra", "eagle"])
def test_committed_heads_are_exact_and_accepted(plain, method):
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(SPEC_PROMPTS, greedy, use_tqdm=False)]
    llm = LLM(MODEL, dtype="float32", num_threads=1, max_model_len=512, kv_cache_memory_gib=0.1, progress=False,
              speculative_config={"method": method, "num_speculative_tokens": 8})
    proposer = llm.engine.speculation.proposer
    assert isinstance(proposer, TreeDrafter)
    trees = []
    real = proposer.propose
    proposer.propose = lambda reqs, ks: [trees.append(d.tree is not None) or d for d in real(reqs, ks)]
    got = [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, greedy, use_tqdm=False)]
    assert got == want
    stats = llm.spec_stats()
    print(method, stats["mean_accepted_length"])
    assert sum(trees) > 10 and stats["mean_accepted_length"] >= 1.5, stats  # trained heads, not noise
    assert llm.engine.blocks.num_free_blocks == llm.engine.kv.num_blocks


def test_eagle_drafts_deeper_than_it_was_trained_and_stays_exact(plain):
    """tree_depth past the trained depth: the layer reads its own outputs once more per level."""
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(SPEC_PROMPTS, greedy, use_tqdm=False)]
    llm = LLM(MODEL, dtype="float32", num_threads=1, max_model_len=512, kv_cache_memory_gib=0.1, progress=False,
              speculative_config={"method": "eagle", "num_speculative_tokens": 12, "tree_depth": 6})
    proposer = llm.engine.speculation.proposer
    assert isinstance(proposer, EagleProposer) and proposer.depth == 6 > proposer.draft.config.depth
    deepest = []
    real = proposer.propose
    proposer.propose = lambda reqs, ks: [deepest.append(max(d.tree.depth) if d.tree else len(d.tokens)) or d
                                         for d in real(reqs, ks)]
    assert [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, greedy, use_tqdm=False)] == want
    assert max(deepest) > proposer.draft.config.depth


def test_committed_heads_fit_the_repository_budget():
    files = sorted(HEADS_DIR.glob("*.safetensors"))
    assert {f.name for f in files} >= {f"{MODEL}-{m}.safetensors" for m in ("medusa", "hydra", "eagle")}
    assert sum(f.stat().st_size for f in files) < 50 * 2**20


def test_missing_or_mismatched_heads_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no trained medusa heads at .*turbospec train-head --model smollm2-135m"):
        LLM(MODEL, dtype="float32", max_model_len=128, kv_cache_memory_gib=0.05, progress=False,
            speculative_config={"method": "medusa", "heads": str(tmp_path / "none.safetensors")})
    DraftHeads(HeadConfig("hydra", 1, 64, 16, "other", 100), torch.arange(10)).save(tmp_path / "small.safetensors", {})
    with pytest.raises(ValueError, match="trained for a model with hidden size 64 and 100 tokens"):
        LLM(MODEL, dtype="float32", max_model_len=128, kv_cache_memory_gib=0.05, progress=False,
            speculative_config={"method": "hydra", "heads": str(tmp_path / "small.safetensors")})
    with pytest.raises(ValueError, match="holds hydra heads, not medusa"):
        LLM(MODEL, dtype="float32", max_model_len=128, kv_cache_memory_gib=0.05, progress=False,
            speculative_config={"method": "medusa", "heads": str(tmp_path / "small.safetensors")})
    with pytest.raises(ValueError, match="heads only applies to methods medusa, hydra"):
        LLM(MODEL, speculative_config={"method": "ngram", "heads": "x"})
    with pytest.raises(ValueError, match="tree_branch must be an integer >= 1"):
        LLM(MODEL, speculative_config={"method": "medusa", "tree_branch": 0})
    with pytest.raises(ValueError, match="tree_depth must be an integer >= 1 or null"):
        LLM(MODEL, speculative_config={"method": "eagle", "tree_depth": 0})
    with pytest.raises(ValueError, match="tree_depth only applies to methods medusa, hydra, eagle, dart, not 'ngram'"):
        LLM(MODEL, speculative_config={"method": "ngram", "tree_depth": 3})
    with pytest.raises(ValueError, match="tree_depth 9 is deeper than the 4 heads"):
        LLM(MODEL, dtype="float32", max_model_len=128, kv_cache_memory_gib=0.05, progress=False,
            speculative_config={"method": "hydra", "tree_depth": 9})


@pytest.mark.parametrize("flags, message", [(["--method", "spin"], "invalid choice: 'spin'"),
                                            (["--method", "medusa", "--num-heads", "0"], "--num-heads must be >= 1"),
                                            (["--method", "hydra", "--budget-minutes", "0"],
                                             "--budget-minutes must be > 0")])
def test_cli_train_head_refuses_bad_flags(flags, message):
    run = subprocess.run([sys.executable, "-m", "turbospec.cli", "train-head", "--model", MODEL, *flags],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_head_path_names_the_model_and_method():
    assert head_path(MODEL, "hydra") == Path(HEADS_DIR) / "smollm2-135m-hydra.safetensors"
