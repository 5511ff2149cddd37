"""Cross-request suffix drafts: which drafts they find and how sure they are, the index's memory bound, and that
speculative output with them stays the target's own."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target
from helpers import PAD, assert_same_as_generate, committed_batch, make_batch

from hf_specformer import OracleProposer, PromptLookupProposer, Proposal, Proposer, SuffixIndex, SuffixProposer
from hf_specformer.generation.acceptance import (
    DRAFTER,
    LOOKUP,
    NO_DRAFT,
    AcceptanceEstimator,
    AcceptanceTable,
    uniform_edges,
)
from hf_specformer.generation.suffix import sorted_ngrams, suffix_drafts


def drafts_of(batch, sequences: list[list[int]], k: int, max_ngram_size: int = 4, **options):
    index = SuffixIndex()
    index.add(torch.tensor(sequence) for sequence in sequences)
    text = index.text("cpu")
    ngrams = {n: sorted_ngrams(text, n) for n in range(2, max_ngram_size + 1)}
    return suffix_drafts(batch, text, ngrams, k, max_ngram_size, **options)


def test_the_most_frequent_continuation_is_drafted_with_its_share_as_confidence():
    earlier = [[1, 2, 3, 4, 5]] * 3 + [[1, 2, 3, 7, 8], [6, 2, 3, 9, 9], [6, 2, 3, 9, 9]]
    batch = committed_batch([
        [8, 8, 2, 3],  # "2 3" occurred 6 times: 3 times -> 4 5, twice -> 9 9, once -> 7 8
        [8, 6, 2, 3],  # "6 2 3" occurred twice (-> 9 9): the longer match wins over the more frequent bigram
        [8, 8, 8, 5],  # nothing
    ])
    drafts, found, confidence = drafts_of(batch, earlier, k=3)
    assert drafts[0, :2].tolist() == [4, 5] and confidence[0].tolist() == pytest.approx([0.5, 0.5, 0.0])
    assert found[0].tolist() == [True, True, False]  # each earlier sequence ends after 2 tokens
    assert drafts[1, :2].tolist() == [9, 9] and confidence[1, :2].tolist() == pytest.approx([1.0, 1.0])
    assert not found[2].any() and not confidence[2].any()


def test_confidence_counts_agreement_slot_by_slot_and_rare_drafts_are_dropped():
    earlier = [[2, 3, 4, 5, 6]] * 2 + [[2, 3, 4, 9, 9]] * 2 + [[2, 3, 7, 7, 7]] * 16
    batch = committed_batch([[8, 8, 2, 3], [8, 9, 3, 4]])
    drafts, found, confidence = drafts_of(batch, earlier, k=3, max_candidates=32, min_confidence=0.15)
    assert drafts[0].tolist() == [7, 7, 7] and confidence[0].tolist() == pytest.approx([0.8, 0.8, 0.8])
    assert drafts[1, :2].tolist() in ([5, 6], [9, 9]) and confidence[1, :2].tolist() == pytest.approx([0.5, 0.5])
    assert found[1].tolist() == [True, True, False]
    rare = drafts_of(batch, earlier, k=3, max_candidates=32, min_confidence=0.85)[1]
    assert not rare[0].any(), "a draft below min_confidence is not proposed"


def test_the_batch_rows_are_matched_against_each_other_within_their_committed_prefixes():
    batch = committed_batch([[5, 6, 7, 8, 9], [4, 3, 5, 6]])  # row 1's "5 6" occurred in row 0
    drafts, found, _ = drafts_of(batch, [], k=4)
    assert drafts[1, :3].tolist() == [7, 8, 9] and found[1].tolist() == [True, True, True, False]
    assert not found[0].any(), "row 0's last bigram occurs nowhere else (the junk after each prefix is not read)"


def test_only_the_latest_candidates_are_counted():
    earlier = [[2, 3, 4]] * 10 + [[2, 3, 5]] * 3  # the latest 4 occurrences: three "5", one "4"
    drafts, _, confidence = drafts_of(committed_batch([[9, 2, 3]]), earlier, k=1, max_candidates=4)
    assert drafts[0].tolist() == [5] and confidence[0].tolist() == pytest.approx([0.75])


def test_the_index_keeps_at_most_max_tokens_dropping_the_oldest():
    index = SuffixIndex(max_tokens=10)
    index.add([torch.arange(4), torch.arange(4, 8), torch.arange(8, 12)])
    assert index.num_tokens == 8 and [s[0].item() for s in index.sequences] == [4, 8]
    index.add([torch.arange(30)])  # longer than the bound: its last 10 tokens
    assert index.num_tokens == 10 and index.sequences[0].tolist() == list(range(20, 30))
    nothing = SuffixIndex(max_tokens=0)
    nothing.add([torch.arange(5)])
    assert len(nothing) == 0 and nothing.text("cpu").numel() == 0
    with pytest.raises(ValueError, match="at least 0"):
        SuffixIndex(max_tokens=-1)


def test_generated_rows_are_added_without_padding():
    index = SuffixIndex()
    sequences = torch.tensor([[PAD, 5, 6, 7, 8, PAD], [4, 5, 6, 7, 9, 9]])
    index.add_generated(sequences, torch.tensor([[0, 1, 1], [1, 1, 1]]), prompt_width=3, pad_token_id=PAD)
    assert [s.tolist() for s in index.sequences] == [[5, 6, 7, 8], [4, 5, 6, 7, 9, 9]]
    assert index.text("cpu").tolist() == [5, 6, 7, 8, -1, 4, 5, 6, 7, 9, 9, -1]


class NetworkOracle(Proposer):
    """An oracle whose drafts come as one-hot network logits (where `draft`), as a drafter's would."""

    def __init__(self, oracle: OracleProposer):
        super().__init__(oracle.num_draft_tokens)
        self.oracle = oracle

    def propose(self, batch, step, caches, draft=True, free=True) -> Proposal:
        if not draft:
            return Proposal()
        ids = self.oracle.draft_ids(batch)
        logits = torch.full((*ids.shape, self.oracle.vocab_size), -torch.inf, dtype=torch.float64)
        return Proposal(logits.scatter_(2, ids[..., None], 0.0))


def test_prompt_lookup_goes_first_and_suffix_drafts_replace_only_weaker_network_drafts():
    """Row 0: prompt lookup finds "5 6" -> 7 5 6, whose first draft the (network) oracle drafts too. Row 1: suffix
    drafts 8 8 then a tie (the latest, 2), expected accepted 1 + 1 + 0.5, below the one-hot oracle's 3: they replace
    its drafts only in a step where it does not draft."""
    batch = committed_batch([[5, 6, 7, 5, 6], [1, 2, 3, 4]])
    oracle = OracleProposer(torch.tensor([[7] * 8, [11] * 8]), num_draft_tokens=3, vocab_size=16, pad_token_id=PAD)
    index = SuffixIndex()
    index.add([torch.tensor([5, 6, 9, 9, 9]), torch.tensor([3, 4, 8, 8, 8]), torch.tensor([3, 4, 8, 8, 2])])
    proposer = SuffixProposer(PromptLookupProposer(NetworkOracle(oracle), max_ngram_size=3), index,
                              min_ngram_size=2)
    drafting = proposer.propose(batch, None, [])
    assert drafting.ids[0].tolist() == [7, 5, 6] and drafting.sources.tolist() == [[LOOKUP] * 3, [DRAFTER] * 3]
    free = proposer.propose(batch, None, [], draft=False)
    assert free.ids.tolist() == [[7, 5, 6], [8, 8, 2]] and (free.sources == LOOKUP).all()
    torch.testing.assert_close(free.confidence.double(), torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.5]],
                               dtype=torch.float64))


def test_a_suffix_proposer_matches_4_grams_by_default():
    """Row 0's last 4 tokens occurred in the index (-> 9 9); row 1 shares only its last 3 with it: nothing."""
    index = SuffixIndex()
    index.add([torch.tensor([1, 2, 3, 4, 9, 9, 9])])
    oracle = OracleProposer(torch.full((2, 8), 11), num_draft_tokens=2, vocab_size=16, pad_token_id=PAD)
    proposer = SuffixProposer(PromptLookupProposer(NetworkOracle(oracle)), index)
    batch = committed_batch([[1, 2, 3, 4], [8, 2, 3, 4]])
    free = proposer.propose(batch, None, [], draft=False)
    assert free.ids[0].tolist() == [9, 9] and free.sources.tolist() == [[LOOKUP] * 2, [NO_DRAFT] * 2]
    with pytest.raises(ValueError, match="min_ngram_size"):
        SuffixProposer(proposer.proposer, index, max_ngram_size=3)


def test_the_estimates_read_a_suffix_drafts_confidence():
    """Uncalibrated, a free draft's estimate is its bin's centre: frequency 0.15 is weighed far below 0.95."""
    estimator = AcceptanceEstimator(AcceptanceTable("confidence", [uniform_edges(10)], num_slots=2), "cpu")
    ids = torch.zeros(2, 2, dtype=torch.long)
    q, _ = estimator.estimate(None, ids, torch.full((2, 2), LOOKUP), fixed_confidence=torch.tensor(
        [[0.15, 0.15], [0.95, 0.95]]))
    assert q[0].tolist() == pytest.approx([0.15, 0.15**2]) and q[1].tolist() == pytest.approx([0.95, 0.95**2])


@pytest.mark.parametrize("kind, batch_size, k, eos, schedule", [
    ("llama", 1, 4, None, "fixed"), ("llama", 8, 3, 2, "goodput"), ("qwen3", 6, 4, 2, "fixed"),
    ("qwen3", 16, 2, None, "goodput"),
])
def test_greedy_with_suffix_drafts_equals_generate_and_learns_across_calls(kind, batch_size, k, eos, schedule):
    """Two calls with one index: the second finds the first's outputs (its prompts are the first's, shifted by a
    row), so suffix drafts supply more of its tokens."""
    target = make_target(kind)
    input_ids, mask = make_batch(batch_size, seed=batch_size, padded=batch_size > 1)
    kwargs = dict(max_new_tokens=40, pad_token_id=PAD, eos_token_id=eos, num_draft_tokens=k, schedule=schedule,
                  lookup_ngram_size=0)
    index = SuffixIndex()
    first = assert_same_as_generate(target, make_drafter(target), input_ids, mask, suffix_index=index, **kwargs)
    assert len(index) == batch_size and first.speculation_stats.looked_up > 0
    second = assert_same_as_generate(target, make_drafter(target), input_ids.roll(1, 0), mask.roll(1, 0),
                                     suffix_index=index, **kwargs)
    assert second.speculation_stats.accepted > first.speculation_stats.accepted
    assert len(index) == 2 * batch_size


def test_suffix_index_argument_is_checked():
    target = make_target("llama")
    input_ids, mask = make_batch(2, seed=1)
    with pytest.raises(TypeError, match="SuffixIndex"):
        assert_same_as_generate(target, make_drafter(target), input_ids, mask, max_new_tokens=4, pad_token_id=PAD,
                                suffix_index="yes")
