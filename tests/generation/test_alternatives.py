"""The alternative draft (`alternatives.py`): slot 1's next-best tokens, each followed by the drafts after it,
verified as branches of their own. Greedy output equals plain `generate` token for token, and a drafter whose first
choice is wrong where its second or third is right gains the branch's tokens per step."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, make_drafter, make_target
from helpers import PAD, assert_same_as_generate, make_batch, noisy_oracle

from hf_specformer import OracleProposer, generate
from hf_specformer.generation.alternatives import alternative_branches, branch_mask, take_alternatives
from hf_specformer.generation.drafting import Proposal

# name: (target kind, drafter, batch size, k, branch length, branches, padded, eos, max_new_tokens)
CASES = {
    "llama-b1-k3-n1-untrained": ("llama", "untrained", 1, 3, 1, 1, False, False, 16),
    "llama-b3-k4-n3-second-pad-eos": ("llama", "second", 3, 4, 3, 1, True, True, 24),
    "llama-b8-k2-n1-c2-third-pad": ("llama", "third", 8, 2, 1, 2, True, False, 30),
    "llama-b4-k3-n3-c3-untrained-pad": ("llama", "untrained", 4, 3, 3, 3, True, False, 20),
    "qwen3-b5-k4-n2-c2-untrained-pad-eos": ("qwen3", "untrained", 5, 4, 2, 2, True, True, 25),
    "qwen3-b16-k3-n3-c2-third-pad-eos": ("qwen3", "third", 16, 3, 3, 2, True, True, 20),
    "qwen3-b1-k1-n4-second": ("qwen3", "second", 1, 1, 4, 1, False, False, 18),
}


class RankedOracle(OracleProposer):
    """A noisy oracle whose slot-1 logits rank `rank - 1` wrong tokens first and the oracle's token at `rank` in a
    share `swap` of its proposals (one-hot elsewhere): the chain then rejects its first draft and the alternative of
    rank `rank` holds the oracle's token."""

    def __init__(self, continuations: torch.LongTensor, k: int, swap: float, rank: int = 2, seed: int = 0):
        super().__init__(continuations, k, TINY_VOCAB, PAD)
        self.swap, self.rank = swap, rank
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, batch, hidden_states, position_ids, source_index, draft=True) -> Proposal:
        logits = super().propose(batch, hidden_states, position_ids, source_index, draft).logits
        if logits is None:
            return Proposal()
        right = logits[:, 0].argmax(-1)
        start = 1 + torch.randint(TINY_VOCAB - self.rank + 1, right.shape, generator=self.generator).to(right.device)
        wrong = (right[:, None] + start[:, None] + torch.arange(self.rank - 1, device=right.device)) % TINY_VOCAB
        scores = torch.arange(self.rank - 1, 0, -1, dtype=logits.dtype, device=right.device).expand(wrong.shape)
        swapped = (torch.rand(right.shape, generator=self.generator) < self.swap).to(right.device)
        first = logits[:, 0].clone()
        first[swapped] = first[swapped].scatter(1, wrong[swapped], scores[swapped])
        logits[:, 0] = first
        return Proposal(logits)


def _eos(reference_new: torch.LongTensor, with_eos: bool):
    return [int(reference_new[0, reference_new.shape[1] // 3])] if with_eos else None


@pytest.mark.parametrize("schedule", ["fixed", "goodput"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_with_the_alternative_draft_equals_generate(case, schedule):
    kind, drafter_kind, batch_size, k, branch_length, branches, padded, with_eos, max_new = CASES[case]
    target = make_target(kind)
    input_ids, mask = make_batch(batch_size, seed=batch_size + k, padded=padded)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new)
    new_tokens = reference[:, input_ids.shape[1]:]
    eos = _eos(new_tokens, with_eos)
    kwargs = dict(max_new_tokens=max_new, pad_token_id=PAD, **({"eos_token_id": eos} if eos else {}))
    if drafter_kind == "untrained":
        assistant, num_draft_tokens = make_drafter(target, draft_length=4), k
    else:
        continuations = noisy_oracle(new_tokens, k, TINY_VOCAB, corrupt=0.2).continuations[:, :-(k + 1)]
        assistant = RankedOracle(continuations, k, swap=0.5, rank=2 if drafter_kind == "second" else 3)
        num_draft_tokens = None
    output = assert_same_as_generate(target, assistant, input_ids, mask, num_draft_tokens=num_draft_tokens,
                                     lookup_ngram_size=0, schedule=schedule, alternative_draft=branch_length,
                                     num_alternatives=branches, **kwargs)
    assert sum(output.speculation_stats.width_counts) == output.speculation_stats.steps


@pytest.mark.parametrize("rank, branches, branch_length, above", [
    (2, 0, 0, None), (2, 1, 1, 1.9), (2, 1, 3, 3.5), (3, 1, 3, None), (3, 2, 1, 1.9), (3, 2, 3, 3.5)])
def test_a_branch_commits_its_tokens_where_the_first_draft_is_wrong(rank, branches, branch_length, above):
    """Slot 1 always ranks the right token at `rank`, slots 2 and 3 are right (k = 3): a step commits one token
    unless a branch holds slot 1's right token, then two with a branch of 1 and all four with a branch of 3."""
    target = make_target("llama")
    input_ids, mask = make_batch(4, seed=3, padded=True)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    oracle = RankedOracle(reference[:, input_ids.shape[1]:], 3, swap=1.0, rank=rank)
    output = assert_same_as_generate(target, oracle, input_ids, mask, lookup_ngram_size=0, schedule="fixed",
                                     max_new_tokens=30, pad_token_id=PAD, alternative_draft=branch_length,
                                     num_alternatives=max(branches, 1))
    tokens_per_step = output.speculation_stats.tokens_per_step
    assert tokens_per_step == 1.0 if above is None else tokens_per_step > above, tokens_per_step


@pytest.mark.parametrize("kwargs, message", [
    ({"do_sample": True}, "do_sample=False"),
    ({"repetition_penalty": 1.3}, "read the prefix"),
    ({"alternative_draft": -1}, "alternative_draft=-1"),
    ({"num_alternatives": 0}, "num_alternatives=0"),
])
def test_the_alternative_draft_refuses_what_it_cannot_verify_exactly(kwargs, message):
    target = make_target("llama")
    input_ids, mask = make_batch(2, seed=0)
    with pytest.raises(ValueError, match=message):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                 max_new_tokens=8, pad_token_id=PAD, schedule="fixed", **{"alternative_draft": True, **kwargs})


def test_branch_mask_hides_the_chains_drafts_from_the_branch_only():
    attention_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1, 1, 1]])  # 3 past columns, 5 inputs
    allowed = branch_mask(attention_mask, 3, 1, 2, torch.float32)[:, 0] == 0  # [B, T, S + T]: chain of 3, branch of 2
    chain = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]]).bool()
    branch = torch.tensor([[1, 1, 1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 0, 0, 1, 1]]).bool()
    for row in range(2):
        hidden = attention_mask[row].bool()
        assert torch.equal(allowed[row, :3], chain & hidden)
        assert torch.equal(allowed[row, 3:], branch & hidden)


def test_branch_mask_hides_each_branch_from_the_others():
    allowed = branch_mask(torch.ones(1, 9, dtype=torch.long), 3, 2, 2, torch.float32)[0, 0] == 0  # 2 past, 7 inputs
    assert allowed[:, :3].all()  # the past and the committed token
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0],  # the chain's drafts
                             [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0],  # the first branch
                             [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]]).bool()  # the second
    assert torch.equal(allowed[1:, 3:], expected)


def test_alternative_branches_and_taking_one():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0], [0.0, 3.0, 2.0, 1.0]])
    tails = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])  # the drafter's own drafts of slots 2, 3: 2, 3
    drafter_logits = torch.stack([logits, tails[0].expand(2, -1), tails[1].expand(2, -1)], dim=1)  # [B, 3, V]
    drafts = torch.tensor([[1, 2, 3], [3, 0, 0]])  # the first draft: the best, or a lookup's (its own tail)
    assert alternative_branches(drafter_logits, drafts, 1, 1).tolist() == [[[2]], [[1]]]
    assert alternative_branches(drafter_logits, drafts, 3, 2).tolist() == [[[2, 2, 3], [3, 2, 3]],
                                                                             [[1, 2, 3], [2, 2, 3]]]
    # rows: first draft rejected (the second branch taken, 2 of its 3 accepted); accepted (chain kept); rejected with
    # alternatives other than the correction; taken but verifying 1 draft only; finished (verifies none)
    tokens = torch.tensor([[2, -1, -1, -1], [1, 3, -1, -1], [0, -1, -1, -1], [7, -1, -1, -1], [2, -1, -1, -1]])
    branches = torch.tensor([[[7, 5, 6], [2, 5, 6]]] * 5)
    predictions = torch.tensor([[[1, 1, 1], [5, 9, 4]]] * 5)  # after 2 the target says 5 (= the branch), then 9
    taken_tokens, num_accepted, taken, choice = take_alternatives(
        tokens, torch.tensor([0, 1, 0, 0, 0]), branches, predictions, torch.tensor([3, 3, 3, 1, 0]))
    assert taken.tolist() == [True, False, False, True, False] and num_accepted.tolist() == [2, 1, 0, 1, 0]
    assert choice[taken].tolist() == [1, 0]
    assert taken_tokens.tolist() == [[2, 5, 9, -1], [1, 3, -1, -1], [0, -1, -1, -1], [7, 1, -1, -1],
                                     [2, -1, -1, -1]]


def test_a_call_with_the_branch_does_not_cache_the_costs_it_learnt():
    """Its steps fed more inputs than their widths say, so a later call without it starts from no costs."""
    target = make_target("llama")
    drafter = make_drafter(target)
    input_ids, mask = make_batch(3, seed=4)
    kwargs = dict(step_costs=None, max_new_tokens=20, pad_token_id=PAD)
    assert_same_as_generate(target, drafter, input_ids, mask, alternative_draft=2, **kwargs)
    later = assert_same_as_generate(target, drafter, input_ids, mask, **kwargs).speculation_stats
    assert later.predicted_seconds_per_step_by_width == [0.0] * (later.num_draft_tokens + 1)
    again = assert_same_as_generate(target, drafter, input_ids, mask, **kwargs).speculation_stats
    assert again.predicted_seconds_per_step_by_width[0] > 0  # the call without the branch cached its costs
