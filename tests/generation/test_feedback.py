"""Never slower by construction: the preallocated cache, deferred drafting, online step costs and the hand-off."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import CPU_ONLY, TINY_VOCAB, make_drafter, make_target
from helpers import PAD, SimulatedClock, assert_same_as_generate, make_batch, optimistic_table, started_batch
from transformers.cache_utils import DynamicCache

from hf_specformer import OracleProposer, Proposal, SpecFormerProposer
from hf_specformer.generation.caching import PreallocatedCache
from hf_specformer.generation import engine, feedback, scheduling
from hf_specformer.generation.feedback import (
    HANDOFF_BACKOFF,
    HANDOFF_CREDIT,
    HANDOFF_LOSS,
    HANDOFF_MARGIN,
    HANDOFF_SPREAD,
    HandOff,
    OnlineStepCosts,
)
from hf_specformer.generation.costs import StepCostModel
from hf_specformer.generation.forwards import cache_argument


def _forward(target, ids, mask, cache, positions):
    return target(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                  **cache_argument(target, cache))


@CPU_ONLY
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_preallocated_cache_equals_dynamic_cache_through_steps_row_selection_and_compaction(kind):
    """The same forwards over both caches (a prefill, steps of several inputs, rows dropped, columns gathered):
    equal logits and equal cached keys and values."""
    target = make_target(kind)
    input_ids, mask = make_batch(4, seed=3)
    dynamic, preallocated = DynamicCache(), PreallocatedCache(target.config.num_hidden_layers, capacity=40)
    generator = torch.Generator().manual_seed(0)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    for step in range(4):
        outputs = [_forward(target, input_ids, mask, cache, positions) for cache in (dynamic, preallocated)]
        torch.testing.assert_close(outputs[0].logits, outputs[1].logits, rtol=0, atol=1e-12)
        if step == 1:  # drop row 1
            keep = torch.tensor([0, 2, 3])
            dynamic.batch_select_indices(keep)
            preallocated.batch_select_indices(keep)
            mask, positions = mask[keep], positions[keep]
        if step == 2:  # keep, per row, a random half of the columns (compaction's gather)
            length = mask.shape[1]
            index = torch.stack([torch.randperm(length, generator=generator)[: length // 2].sort().values
                                 for _ in range(mask.shape[0])])
            for layer in dynamic.layers:
                expanded = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                layer.keys, layer.values = layer.keys.gather(2, expanded), layer.values.gather(2, expanded)
            preallocated.gather_columns(index)
            mask = mask.gather(1, index)
        input_ids = torch.randint(3, TINY_VOCAB, (mask.shape[0], 3), generator=generator)
        positions = positions[:, -1:] + 1 + torch.arange(3)
        mask = torch.cat([mask, torch.ones(mask.shape[0], 3, dtype=mask.dtype)], dim=1)
    for ours, theirs in zip(preallocated.layers, dynamic.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    assert preallocated.get_seq_length() == dynamic.get_seq_length() == preallocated.columns


def test_preallocated_cache_refuses_to_overflow():
    cache = PreallocatedCache(1, capacity=4)
    cache.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), 0)
    with pytest.raises(RuntimeError, match="holds 4 columns"):
        cache.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), 0)


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
    for proposer in (every, deferring):
        proposer.start(64)
    positions = batch.prompt_position_ids()
    output = target(input_ids=input_ids, attention_mask=mask, position_ids=positions, **cache_argument(target, cache),
                    output_hidden_states=True)
    batch.commit_prompt()
    generator = torch.Generator().manual_seed(1)
    source = torch.full((3,), input_ids.shape[1] - 1)
    for step, (inputs, accepted) in enumerate([(1, 1), (3, 2), (1, 1)]):
        batch.commit_tokens(torch.randint(3, TINY_VOCAB, (3, 1), generator=generator), torch.ones(3, dtype=torch.long))
        logits = [proposer.propose(batch, output.hidden_states, positions, source, draft=step == 2 or proposer is every)
                  .logits for proposer in (every, deferring)]
        if step < 2:  # deferred: its cache lags behind
            assert logits[1] is None and deferring.cache.get_seq_length() < every.cache.get_seq_length()
        else:
            torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-9)
            assert deferring.cache.get_seq_length() == every.cache.get_seq_length()
        step_ids = torch.randint(3, TINY_VOCAB, (3, inputs), generator=generator)
        step_mask, positions = batch.step_inputs(inputs)
        output = target(input_ids=step_ids, attention_mask=step_mask, position_ids=positions,
                        **cache_argument(target, cache),
                        output_hidden_states=True)
        batch.commit_cache(torch.full((3,), accepted), inputs)
        source = torch.full((3,), accepted - 1)


def test_online_costs_correct_a_wrong_profile_and_fit_a_line_without_one():
    profile = StepCostModel([1, 8], [[1.0, 2.0], [8.0, 16.0]], [0.1, 0.8])
    costs = OnlineStepCosts(profile)
    costs.observe_plain(8, 16.0)
    assert costs.plain(4) == pytest.approx(8.0)  # the first timing sets the scale (the guard trusts t_plain at once)
    assert costs.draft(8) == pytest.approx(0.8)  # other costs keep the profile's until they are timed
    for _ in range(30):  # the machine is twice as slow as the profile says
        costs.observe_plain(8, 16.0)
        costs.observe_verify(8, 16, 32.0)
        costs.observe_draft(8, 1.6)
    assert costs.plain(4) == pytest.approx(8.0, rel=1e-3) and costs.draft(4) == pytest.approx(0.8, rel=1e-3)
    assert costs.verify(8, 12) == pytest.approx(24.0, rel=1e-3)
    cold = OnlineStepCosts()
    assert not cold.known
    cold.observe_plain(4, 5.0)
    assert cold.plain(8) == cold.plain(2) == pytest.approx(5.0)  # one batch size seen: a constant
    for rows in (2, 4, 8, 16):
        cold.observe_plain(rows, 3.0 + 0.5 * rows)
    assert cold.plain(32) == pytest.approx(19.0, rel=0.05)  # a + b x once sizes differ
    cold.observe_verify(8, 32, cold.plain(8) + 6.0)  # verifying 24 drafts cost 6 s more than a plain step
    assert cold.verify(8, 16) == pytest.approx(cold.plain(8) + 2.0, rel=1e-3)  # 8 drafts: a third of that


def test_handoff_once_the_deficit_exceeds_its_bound_with_doubling_backoff():
    costs = OnlineStepCosts(StepCostModel([1, 8], [[1.0, 2.0], [8.0, 16.0]], [0.1, 0.8]))  # t_plain(8) = 8 s
    guard = HandOff(costs)
    excess = 20.0 - (1 + HANDOFF_MARGIN) * 12.0  # 1.5 tokens per row for 2.5x a plain step's time
    first = int((HANDOFF_CREDIT + HANDOFF_LOSS) * 8.0 // excess) + 1  # a call starts with the credit
    for _ in range(first - 1):
        guard.observe(8, 8, 12, 20.0)
        assert not guard.active
    guard.observe(8, 8, 12, 20.0)
    assert guard.active and guard.plain_steps_left == HANDOFF_BACKOFF and guard.deficit == 0.0
    for _ in range(HANDOFF_BACKOFF):
        guard.plain_step()
    assert not guard.active
    for _ in range(int(HANDOFF_LOSS * 8.0 // excess) + 1):  # after a hand-off, from zero
        guard.observe(8, 8, 12, 20.0)
    assert guard.plain_steps_left == 2 * HANDOFF_BACKOFF


def test_handoff_deficit_is_floored_so_gains_buy_only_their_credit_of_later_losses_and_small_losses_add_up():
    costs = OnlineStepCosts(StepCostModel([1, 8], [[1.0, 2.0], [8.0, 16.0]], [0.1, 0.8]))
    guard = HandOff(costs)
    for _ in range(50):  # 2 tokens per row for 1.5x: ahead, never handed off, credit capped
        guard.observe(8, 8, 16, 12.0)
    assert guard.deficit == pytest.approx(-HANDOFF_CREDIT * 8.0) and not guard.active
    slow = 8.0 * (1 + HANDOFF_MARGIN) + 0.5  # plain tokens, half a second slower than the margin allows
    for step in range(1, 100):
        guard.observe(8, 4, 4, slow)  # 4 of 8 rows still generating, one token each: a plain step's worth
        if guard.active:
            break
    assert step == int((HANDOFF_CREDIT + HANDOFF_LOSS) * 8.0 / 0.5) + 1
    streaky = HandOff(costs)  # a winning call whose losses come in streaks: 5 losing steps after every 5 gaining
    for _ in range(20):
        for _ in range(5):
            streaky.observe(8, 8, 20, 12.0)  # 2.5 tokens per row for 1.5x
        for _ in range(5):
            streaky.observe(8, 8, 8, 8.0 * (1 + HANDOFF_MARGIN) + 2.0)  # a quarter plain step lost each
    assert streaky.handoffs == 0
    fresh = HandOff(costs)  # no gains yet: a call starts with the credit, so the same streak has to last longer
    for step in range(1, 100):
        fresh.observe(8, 8, 8, 8.0 * (1 + HANDOFF_MARGIN) + 2.0)
        if fresh.active:
            break
    assert step == int((HANDOFF_CREDIT + HANDOFF_LOSS) * 8.0 / 2.0) + 1
    investing = HandOff(costs)
    investing.observe(8, 8, 8, 8.0, proposing_seconds=12.0)  # drafting worth 1.5 plain steps, weighed next step
    assert not investing.active and investing.deficit == pytest.approx(12.0 - HANDOFF_CREDIT * 8.0)  # floored
    investing.observe(8, 8, 24, 16.0)  # which reaps it: 3 tokens per row in 2 plain steps' time
    assert not investing.active and investing.deficit < 8.0
    padding_only = HandOff(costs)
    padding_only.observe(8, 0, 0, 100.0)  # no live rows: nothing to weigh
    assert padding_only.deficit is None


def test_handoff_bound_widens_with_the_predicted_spread_of_a_steps_tokens_per_row():
    """One row whose verified drafts promise a spread of one token per step: a losing streak that would hand a call
    off with no spread must run HANDOFF_SPREAD plain steps deep first; a steadily losing call still hands off, at the
    wider bound. At B = 16 the same spread per row averages out: the bound stays HANDOFF_LOSS."""
    costs = OnlineStepCosts(StepCostModel([1, 16], [[1.0, 2.0], [16.0, 32.0]], [0.1, 1.6]))  # t_plain(1) = 1 s
    excess = 1.25 - (1 + HANDOFF_MARGIN) * 1.0  # each step: one token for 1.25 plain steps' time

    def steps_to_handoff(guard, batch_size, predicted_variance):
        for step in range(1, 200):
            guard.observe(batch_size, batch_size, batch_size, 1.25 * batch_size,
                          predicted_variance=predicted_variance)
            if guard.active:
                return step

    assert steps_to_handoff(HandOff(costs), 1, 0.0) == int((HANDOFF_CREDIT + HANDOFF_LOSS) / excess) + 1
    assert HANDOFF_SPREAD > HANDOFF_LOSS
    spread = HandOff(costs)
    assert steps_to_handoff(spread, 1, 1.0) == int((HANDOFF_CREDIT + HANDOFF_SPREAD) / excess) + 1
    assert spread.bound == pytest.approx(HANDOFF_SPREAD)
    batched = HandOff(costs)
    assert steps_to_handoff(batched, 16, 16 * 1.0) == int((HANDOFF_CREDIT + HANDOFF_LOSS) / excess) + 1
    assert batched.bound == HANDOFF_LOSS


def test_handoff_weighs_a_step_that_verified_nothing_by_its_proposing_only():
    """Steps that had proposals but verified none ran plain forwards: however slow the machine ran them (drift since
    t_plain was learnt), they add nothing but the proposing before the next step, and drafting for steps that
    never verify still hands off."""
    costs = OnlineStepCosts(StepCostModel([1, 8], [[1.0, 2.0], [8.0, 16.0]], [0.1, 0.8]))  # t_plain(8) = 8 s
    drifted = HandOff(costs)
    for _ in range(100):
        drifted.observe(8, 8, 8, 12.0, verified=False)  # the machine at 1.5x: a plain step's work all the same
    assert drifted.deficit == -HANDOFF_CREDIT * 8.0 and drifted.handoffs == 0
    weighed = HandOff(costs)
    weighed.observe(8, 8, 8, 12.0)  # the same seconds for a step that verified drafts (all rejected)
    assert weighed.deficit == pytest.approx(-HANDOFF_CREDIT * 8.0 + 12.0 - (1 + HANDOFF_MARGIN) * 8.0)
    drafting = HandOff(costs)
    for step in range(1, 100):
        drafting.observe(8, 8, 8, 8.0, proposing_seconds=1.0, verified=False)  # drafts, then verifies none
        if drafting.active:
            break
    assert step == int((HANDOFF_CREDIT + HANDOFF_LOSS) * 8.0 / 1.0) + 2  # the outlay passes the bound, tested next


class ConfidentWrongOracle(OracleProposer):
    """An oracle whose drafts are all wrong, with a calibrated table that expects 90% of them accepted: the
    scheduler's estimates say drafting pays while every verified draft is rejected."""

    def __init__(self, reference_new_tokens: torch.LongTensor, k: int):
        super().__init__((reference_new_tokens + 1) % TINY_VOCAB, k, TINY_VOCAB, PAD)
        self.config = SimpleNamespace(acceptance_table=optimistic_table("confidence"))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_losing_call_goes_over_to_plain_steps_mid_call_and_still_equals_generate(kind, monkeypatch):
    """Speculation that can only lose (every draft rejected, a table that expects 90% accepted), on a simulated
    clock: after its first verified drafts the guard hands the call off, and it runs plain steps (the drafter
    deferred, the estimates learning the rejections, speculation retried ever more rarely); the greedy output
    (ragged rows, EOS) is still `generate`'s. The guard's own rule is tested above."""
    monkeypatch.setattr(engine, "StepClock", SimulatedClock)
    target = make_target(kind)
    input_ids, mask = make_batch(4, seed=21)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=80)
    new_tokens = reference[:, input_ids.shape[1]:]
    output = assert_same_as_generate(
        target, ConfidentWrongOracle(new_tokens, 3), input_ids, mask, lookup_ngram_size=0, step_costs=None,
        max_new_tokens=80, pad_token_id=PAD, eos_token_id=int(new_tokens[0, 50]),
    )
    stats = output.speculation_stats
    assert stats.accepted == 0 and stats.drafted > 0 and stats.handoffs >= 1
    assert stats.width_counts[0] > 0.9 * stats.steps and stats.drafting_steps < stats.steps // 8, stats.width_counts


class HandOffEverySecondStep(HandOff):
    """A guard that hands off after every second step it weighs, whatever the timings (its rule is tested above;
    this one forces hand-offs at known points of a call)."""

    weighed = 0

    def observe(self, batch_size: int, num_live: int, committed: int, seconds: float,
                proposing_seconds: float = 0.0, verified: bool = True, predicted_variance: float = 0.0) -> None:
        if self.active:
            return
        self.weighed += 1
        if self.weighed % 2 == 0:
            self.plain_steps_left = self.backoff * 2**self.handoffs
            self.handoffs += 1


class OracleSpecFormer(SpecFormerProposer):
    """The SpecFormer drafter's work (its context cache, deferred through plain steps), with a known continuation's
    tokens as its drafts (`OracleProposer`), so every draft is accepted."""

    def __init__(self, drafter, continuations: torch.LongTensor, vocab_size: int):
        super().__init__(drafter)
        self.oracle = OracleProposer(continuations, self.num_draft_tokens, vocab_size, PAD)

    def propose(self, batch, hidden_states, position_ids, source_index, draft=True) -> Proposal:
        proposal = super().propose(batch, hidden_states, position_ids, source_index, draft)
        return self.oracle.propose(batch, hidden_states, position_ids, source_index) if proposal.drafted else proposal


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_hand_offs_forced_mid_call_keep_the_output_of_generate(kind, monkeypatch):
    """Hand-offs forced every second speculative step, with a back-off of 2 plain steps (then 4, 8, ...): the call
    alternates verification steps and spells of plain steps (nothing proposed, the drafter deferred), and the
    greedy output (ragged rows, EOS at different steps) is still `generate`'s. On the simulated clock, with the
    drafter's work run (and deferred) but the reference's tokens as its drafts, so that drafting pays and
    verification steps happen whatever the machine's load."""
    monkeypatch.setattr(scheduling, "HandOff", HandOffEverySecondStep)
    monkeypatch.setattr(feedback, "HANDOFF_BACKOFF", 2)
    monkeypatch.setattr(engine, "StepClock", SimulatedClock)
    target = make_target(kind)
    input_ids, mask = make_batch(5, seed=8)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=60)
    drafter = OracleSpecFormer(make_drafter(target), reference[:, input_ids.shape[1]:], target.config.vocab_size)
    stats = assert_same_as_generate(
        target, drafter, input_ids, mask, step_costs=None, max_new_tokens=60, pad_token_id=PAD,
        eos_token_id=int(reference[1, input_ids.shape[1] + 20]),
    ).speculation_stats
    assert stats.handoffs >= 3 and sum(stats.width_counts[1:]) >= 3, (stats.handoffs, stats.width_counts)
    assert stats.width_counts[0] >= 2 + 4 + 8, stats.width_counts


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_call_without_step_costs_measures_a_plain_step_first_and_equals_generate(kind):
    """No profile cached and none given: the call does not profile; its first step is a plain one, every step's
    seconds are in the statistics, and what it learnt is cached for its own batch size (not for the sizes its rows
    shrank to as they finished), so the next call at that size starts from it."""
    target = make_target(kind)
    drafter = make_drafter(target)
    input_ids, mask = make_batch(5, seed=4)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    kwargs = dict(step_costs=None, max_new_tokens=30, pad_token_id=PAD,
                  eos_token_id=int(reference[2, input_ids.shape[1] + 12]))  # rows finish at different steps
    stats = assert_same_as_generate(target, drafter, input_ids, mask, **kwargs).speculation_stats
    assert stats.width_counts[0] >= 1 and stats.drafting_steps >= 1
    assert stats.seconds_per_step_by_width[0] > 0
    assert stats.predicted_seconds_per_step_by_width == [0.0] * (stats.num_draft_tokens + 1)  # no profile
    (cached,) = (Path(os.environ["HF_SPECFORMER_CACHE"]) / "step_costs").iterdir()
    assert StepCostModel.load(cached).batch_sizes == [5]
    again = assert_same_as_generate(target, drafter, input_ids, mask, **kwargs).speculation_stats
    assert again.predicted_seconds_per_step_by_width[0] > 0  # the first call's learnt costs
