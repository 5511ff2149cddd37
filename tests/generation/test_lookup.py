"""Prompt lookup: which drafts it finds, and that speculative output with it stays the target's own."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_drafter, make_target
from helpers import PAD, assert_same_as_generate, committed_batch, make_batch

from hf_specformer import PromptLookupProposer, SpecFormerProposer
from hf_specformer.generation.drafting import Proposal, lookup_drafts, lookup_overrides


def test_lookup_finds_the_latest_longest_match_and_stops_at_the_prefix():
    batch = committed_batch([
        [5, 6, 7, 8, 5, 6, 9, 4, 5, 6],  # "5 6" twice before the end: the latest (-> 9 4 5 6) wins
        [1, 2, 3, 4, 2, 3, 8, 1, 2, 3],  # "1 2 3" (-> 4 2 3 ...) beats the later "2 3" (-> 8 ...)
        [3, 4, 5, 6, 7],  # no repeated bigram
        [7, 8, 3, 7, 8],  # match near the end: only 3 committed tokens follow it
    ])
    drafts, found, matched = lookup_drafts(batch, num_draft_tokens=4, max_ngram_size=3)
    assert matched.tolist() == [2, 3, 0, 2]
    assert drafts[0].tolist() == [9, 4, 5, 6] and found[0].all()
    assert drafts[1].tolist() == [4, 2, 3, 8] and found[1].all()
    assert not found[2].any()
    assert drafts[3, :3].tolist() == [3, 7, 8] and found[3].tolist() == [True, True, True, False]


def test_a_lookup_match_replaces_only_network_drafts_that_disagree_with_less_confidence_than_its_n_asks():
    """Rows: network 0.8 sure of another first token (a 2-gram match yields, a 4-gram match replaces it); network
    0.95 sure (kept against a 4-gram too); network agrees (replaced whatever its confidence); no network drafts."""
    vocab = 8
    logits = torch.full((3, 2, vocab), -30.0)
    for row, (token, probability) in enumerate([(1, 0.8), (1, 0.95), (4, 0.99)]):
        logits[row, :, token] = math.log(probability)
        logits[row, :, 0] = math.log(1 - probability)
    ids = torch.tensor([[4, 5], [4, 5], [4, 5]])
    network = Proposal(logits)
    assert lookup_overrides(network, ids, torch.tensor([2, 4, 2])).tolist() == [False, False, True]
    assert lookup_overrides(network, ids, torch.tensor([4, 6, 2])).tolist() == [True, False, True]
    assert lookup_overrides(Proposal(), ids, torch.tensor([2, 2, 2])).all()


def test_lookup_needs_at_least_a_bigram():
    batch = committed_batch([[4, 9, 5, 6, 4]])  # "4" recurs, but no bigram does
    assert not lookup_drafts(batch, num_draft_tokens=2, max_ngram_size=4)[1].any()
    with pytest.raises(ValueError, match="at least 2"):
        PromptLookupProposer(SpecFormerProposer(make_drafter(make_target()), 2), max_ngram_size=1)


@pytest.mark.parametrize("kind, batch_size, k, eos", [("llama", 1, 4, None), ("llama", 8, 3, 2), ("qwen3", 6, 4, 2),
                                                      ("qwen3", 16, 2, None)])
def test_greedy_with_lookup_equals_generate(kind, batch_size, k, eos):
    """Tiny random targets repeat themselves, so lookup supplies many drafts (checked), right and wrong."""
    target = make_target(kind)
    input_ids, mask = make_batch(batch_size, seed=batch_size, padded=batch_size > 1)
    kwargs = dict(max_new_tokens=40, pad_token_id=PAD, eos_token_id=eos)
    output = assert_same_as_generate(target, make_drafter(target), input_ids, mask, num_draft_tokens=k,
                                     lookup_ngram_size=3, **kwargs)
    stats = output.speculation_stats
    assert stats.looked_up > 0 and stats.accepted < stats.drafted


def test_a_lookup_proposer_is_not_wrapped_again():
    target = make_target("llama")
    input_ids, mask = make_batch(2, seed=5)
    proposer = PromptLookupProposer(SpecFormerProposer(make_drafter(target), 3), max_ngram_size=3)
    output = assert_same_as_generate(target, proposer, input_ids, mask, max_new_tokens=20, pad_token_id=PAD)
    assert output.speculation_stats is proposer.stats and proposer.stats.looked_up > 0


def test_lookup_raises_acceptance_on_repetitive_text_and_can_be_turned_off():
    """A target that loops: with lookup, drafts past the first loop are accepted; without, none are looked up."""
    target = make_target("llama")
    input_ids, mask = make_batch(4, seed=4)
    runs = {
        size: assert_same_as_generate(target, make_drafter(target), input_ids, mask, num_draft_tokens=4,
                                      schedule="fixed",
                                      lookup_ngram_size=size, max_new_tokens=60, pad_token_id=PAD,
                                      eos_token_id=None).speculation_stats
        for size in (0, 4)
    }
    assert runs[0].looked_up == 0 and runs[4].looked_up > 0
    assert runs[4].tokens_per_step > runs[0].tokens_per_step + 0.5
