"""Proposers: prompt lookup's drafts and when they replace the network's, the drafter's deferred context stage,
and that speculative output with them stays the target's own."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CPU_ONLY, TINY_VOCAB, make_drafter, make_target
from helpers import PAD, assert_same_as_generate, committed_batch, make_batch, started_batch

from hf_specformer import PromptLookupProposer, Proposer, SpecFormerProposer, TargetStep
from hf_specformer.generation.cache import PreallocatedCache
from hf_specformer.generation.proposers import Proposal, ngram_lookup


def lookup(batch, num_draft_tokens: int, max_ngram_size: int):
    return ngram_lookup(batch.tokens[batch.row_ids], batch.prefix_lengths(), num_draft_tokens, max_ngram_size)


def test_lookup_finds_the_latest_longest_match_and_stops_at_the_prefix():
    batch = committed_batch([
        [5, 6, 7, 8, 5, 6, 9, 4, 5, 6],  # "5 6" twice before the end: the latest (-> 9 4 5 6) wins
        [1, 2, 3, 4, 2, 3, 8, 1, 2, 3],  # "1 2 3" (-> 4 2 3 ...) beats the later "2 3" (-> 8 ...)
        [3, 4, 5, 6, 7],  # no repeated bigram
        [7, 8, 3, 7, 8],  # match near the end: only 3 committed tokens follow it
    ])
    drafts, found, matched = lookup(batch, num_draft_tokens=4, max_ngram_size=3)
    assert matched.tolist() == [2, 3, 0, 2]
    assert drafts[0].tolist() == [9, 4, 5, 6] and found[0].all()
    assert drafts[1].tolist() == [4, 2, 3, 8] and found[1].all()
    assert not found[2].any()
    assert drafts[3, :3].tolist() == [3, 7, 8] and found[3].tolist() == [True, True, True, False]


def test_a_lookup_match_replaces_only_network_drafts_that_disagree_with_less_confidence_than_its_n_asks():
    """Rows: network 0.8 sure of another first token (a 2-gram match yields, a 4-gram match replaces it); network
    0.95 sure (kept); network agrees (replaced); fixed drafts of another source (kept)."""
    batch = committed_batch([[4, 5, 1, 4, 5]] * 4 + [[3, 9, 4, 5, 1, 3, 9, 4, 5]])
    vocab = 12
    logits = torch.full((5, 2, vocab), -30.0)
    for row, (token, probability) in enumerate([(2, 0.8), (2, 0.95), (1, 0.9), (2, 0.1), (2, 0.8)]):
        logits[row, :, token] = math.log(probability)
        logits[row, :, 0] = math.log(1 - probability)
    sources = torch.tensor([[0, 0]] * 3 + [[1, 1]] + [[0, 0]])  # row 3: fixed drafts already (e.g. an oracle's)
    inner = Proposal(logits, ids=torch.full((5, 2), 7), sources=sources)

    class Fixed(Proposer):  # returns `inner`
        def propose(self, batch, step, caches, draft=True, free=True):
            return inner

    proposal = PromptLookupProposer(Fixed(2), max_ngram_size=4).propose(batch, None, [])
    assert (proposal.sources == 1).tolist() == [[False, False], [False, False], [True, True], [True, True],
                                                [True, True]]
    assert proposal.ids[:, 0].tolist() == [7, 7, 1, 7, 1]  # rows 0 and 4: a 2-gram match yields, a 4-gram replaces


def test_lookup_needs_at_least_a_bigram():
    batch = committed_batch([[4, 9, 5, 6, 4]])  # "4" recurs, but no bigram does
    assert not lookup(batch, num_draft_tokens=2, max_ngram_size=4)[1].any()
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
    output = assert_same_as_generate(target, proposer, input_ids, mask, schedule="fixed", max_new_tokens=20,
                                     pad_token_id=PAD)
    assert output.speculation_stats.looked_up > 0


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


@CPU_ONLY
@pytest.mark.parametrize("kind, next_token_input", [("llama", False), ("qwen3", False), ("llama", True)])
def test_deferred_drafting_gives_the_drafts_of_drafting_every_step(kind, next_token_input):
    """A proposer that skips drafting for two steps (deferring its context stage, one step with a rejected input)
    then drafts gives the draft logits of one that ran its context stage every step."""
    target = make_target(kind)
    drafter = make_drafter(target, next_token_input=next_token_input)
    for module in drafter.modules():  # a trained next-token projection (it starts at zero)
        if type(module).__name__ == "SpecFormerNextTokenInput":
            torch.nn.init.normal_(module.weight, std=0.5)
    input_ids, mask = make_batch(3, seed=6)
    cache = PreallocatedCache(target.config.num_hidden_layers, capacity=64)
    batch = started_batch(input_ids, mask, 16, PAD)
    every, deferring = SpecFormerProposer(drafter, 3), SpecFormerProposer(drafter, 3)
    caches = {every: [PreallocatedCache(1, 64)], deferring: [PreallocatedCache(1, 64)]}
    positions = batch.prompt_position_ids()  # of the prompts' last W columns, the longest prompt's
    output = target(input_ids=input_ids[:, -batch.columns:], attention_mask=batch.attention_mask.clone(),
                    position_ids=positions, output_hidden_states=True, cache=cache)
    generator = torch.Generator().manual_seed(1)
    last = torch.full((3,), batch.columns - 1)
    for step, (inputs, accepted) in enumerate([(1, 1), (3, 2), (1, 1)]):
        batch.commit_tokens(torch.randint(3, TINY_VOCAB, (3, 1), generator=generator), torch.ones(3, dtype=torch.long))
        target_step = TargetStep(output.hidden_states, positions, last)
        logits = [proposer.propose(batch, target_step, caches[proposer], draft=step == 2 or proposer is every)
                  .logits for proposer in (every, deferring)]
        lengths = [caches[proposer][0].get_seq_length() for proposer in (every, deferring)]
        if step < 2:  # deferred: its cache lags behind
            assert logits[1] is None and lengths[1] < lengths[0]
        else:
            torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-9)
            assert lengths[0] == lengths[1]
        step_ids = torch.randint(3, TINY_VOCAB, (3, inputs), generator=generator)
        positions = batch.lengths[:, None] + torch.arange(inputs)
        output = target(input_ids=step_ids, attention_mask=batch.step_mask(torch.ones(3, inputs, dtype=torch.long)),
                        position_ids=positions, output_hidden_states=True, cache=cache)
        batch.commit_cache(torch.full((3,), accepted), inputs)
        last = torch.full((3,), accepted - 1)


