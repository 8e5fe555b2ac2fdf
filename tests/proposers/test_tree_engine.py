"""Token trees inside the engine: an oracle proposer hides the target's true continuation among decoy branches, so
verification accepts deep paths off the first branch and their K/V must be compacted for later tokens to stay
right. Output must equal plain decoding (bitwise under the batch-invariant mode). The oracle is a test double
for a real tree proposer (the heads in test_heads.py), built to force deep, non-trivial compaction."""

from __future__ import annotations

import random

import pytest
from spec_prompts import SPEC_PROMPTS

from turbospec import LLM, SamplingParams
from turbospec.draft import Draft
from turbospec.proposers.base import Proposer
from turbospec.request import Request
from turbospec.verification.tree import TokenTree

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)


class OracleTreeProposer(Proposer):
    """Knows each prompt's greedy answer; builds trees of decoys with the true path somewhere among them, cut
    short at a random depth (so both full and partial acceptance happen)."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], seed: int = 0) -> None:
        self.answers = answers
        self.rng = random.Random(seed)
        self.trees = 0

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        drafts = []
        for req, k in zip(requests, num_tokens):
            full = self.answers[tuple(req.prompt_token_ids)]
            done = req.num_output_tokens
            truth = full[done: done + self.rng.randint(0, 4)]
            paths = [[self.rng.randrange(100, 5000) for _ in range(self.rng.randint(1, 3))] for _ in range(3)]
            paths.insert(self.rng.randint(0, 3), truth)
            if not req.accepts_trees:  # as real proposers do: a deterministic request verifies one path
                paths = [p for p in paths if p][:1]
            tree = TokenTree.from_paths([p for p in paths if p])
            keep = min(k, len(tree))
            tree = TokenTree(tree.tokens[:keep], tree.parents[:keep])  # parents come first: still a tree
            self.trees += not tree.is_chain
            drafts.append(Draft(tree.tokens, tree=tree))
        return drafts


def _run(llm: LLM, prompts: list[str], params: SamplingParams) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(tuple(o.outputs[0].token_ids),
             tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items())) for step in o.outputs[0].logprobs))
            for o in outs]


@pytest.mark.parametrize("mode", [None, "batch-invariant"])
def test_tree_verification_with_compaction_equals_plain_decoding(mode):
    dtype = "float32" if mode is None else "bfloat16"
    plain = LLM(MODEL, dtype=dtype, num_threads=1, max_model_len=256, kv_cache_memory_gib=0.1, progress=False,
                deterministic=mode)
    want = _run(plain, SPEC_PROMPTS, GREEDY)
    answers = {tuple(o.prompt_token_ids): o.outputs[0].token_ids
               for o in plain.generate(SPEC_PROMPTS, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                                       use_tqdm=False)}
    spec = LLM(MODEL, dtype=dtype, num_threads=1, max_model_len=256, kv_cache_memory_gib=0.1, progress=False,
               deterministic=mode, speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    oracle = OracleTreeProposer(answers)
    spec.engine.speculation.proposer = oracle
    moves = []
    real_move = spec.engine.runner.move_kv
    spec.engine.runner.move_kv = lambda rid, src, dst: (moves.append(len(src)), real_move(rid, src, dst))
    got = _run(spec, SPEC_PROMPTS, GREEDY)
    stats = spec.spec_stats()
    if mode is None:  # float32: the same tokens; log-probs within float noise of a different batch shape
        assert [g[0] for g in got] == [w[0] for w in want]
        assert oracle.trees > 20 and stats["mean_accepted_length"] > 2.0, stats
        assert sum(1 for m in moves if m) > 5  # accepted paths off the first branch were moved down
        # acceptance by depth, not by node: the oracle's trees are at most 4 deep with up to 8 nodes
        assert len(stats["num_draft_tokens_per_pos"]) <= 4
        assert sum(stats["num_accepted_tokens_per_pos"]) == stats["num_accepted_tokens"]
        assert stats["num_draft_tokens"] > sum(stats["num_draft_tokens_per_pos"])  # nodes beyond one per depth
    else:  # batch-invariant: requests get chains (accepts_trees), and tokens and log-probs are bitwise plain's
        assert got == want
        assert oracle.trees == 0 and stats["num_accepted_tokens"] > 20, stats
    assert spec.engine.blocks.num_free_blocks == spec.engine.kv.num_blocks


def test_sampled_tree_verification_is_seeded():
    spec = LLM(MODEL, dtype="float32", num_threads=1, max_model_len=256, kv_cache_memory_gib=0.1, progress=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    plain = LLM(MODEL, dtype="float32", num_threads=1, max_model_len=256, kv_cache_memory_gib=0.1, progress=False)
    answers = {tuple(o.prompt_token_ids): o.outputs[0].token_ids
               for o in plain.generate(SPEC_PROMPTS, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                                       use_tqdm=False)}
    spec.engine.speculation.proposer = OracleTreeProposer(answers)
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=30, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in spec.generate(SPEC_PROMPTS, params, use_tqdm=False)]
    spec.engine.speculation.proposer = OracleTreeProposer(answers)  # same trees again
    again = [o.outputs[0].token_ids for o in spec.generate(SPEC_PROMPTS, params, use_tqdm=False)]
    assert first == again and all(len(t) == 30 for t in first)
    assert spec.spec_stats()["num_accepted_tokens"] > 0
