"""How many drafts a row verifies: the fixed schedule's threshold, the goodput scheduler's choice and costs, and the
guard that hands a losing call over to plain steps (each rule alone, then calls that must still equal `generate`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_VOCAB, make_drafter, make_target
from helpers import PAD, assert_same_as_generate, make_batch, optimistic_table

from hf_specformer import OracleProposer, Proposal, SpecFormerProposer, StepCosts
from hf_specformer.generation import engine, scheduler
from hf_specformer.generation.scheduler import (
    HANDOFF_BACKOFF,
    HANDOFF_CREDIT,
    HANDOFF_LOSS,
    HANDOFF_MARGIN,
    PLAIN_REFRESH_STEPS,
    FixedSchedule,
    GoodputSchedule,
    HandOff,
    StepClock,
    TimedStep,
    longest_confident_prefix,
)

LINEAR = StepCosts(plain=1.0, per_input=0.4, draft=0.05, learn=False)
"""t(B, w) = B (1 + 0.4 w), t_draft(B) = 0.05 B."""


def step(batch_size: int = 8, width: int = 1, num_live: int | None = None, accepted: int = 0, proposed: bool = True,
         proposing: bool = True, drafted: bool = False) -> TimedStep:
    return TimedStep(batch_size, width, batch_size if num_live is None else num_live, accepted, proposed, proposing,
                     drafted)


def test_longest_prefix_above_threshold_and_at_least_one():
    confidence = torch.tensor([[1.0, 1.0, 0.9, 0.1], [0.5, 0.5, 1.0, 1.0], [0.05, 1.0, 1.0, 1.0], [0.9, 0.1, 1.0, 1.0],
                               [0.0, 0.0, 0.0, 0.0]])
    cumulative = confidence.cumprod(1)  # [1, 1, .9, .09], [.5, .25, .25, .25], [.05, ...], [.9, .09, ...], no drafts
    assert longest_confident_prefix(cumulative, 0.2).tolist() == [3, 4, 1, 1, 0]
    assert longest_confident_prefix(cumulative, 0.0).tolist() == [4, 4, 4, 4, 0]
    assert longest_confident_prefix(cumulative, 1.0).tolist() == [2, 1, 1, 1, 0]
    fixed = FixedSchedule(4)
    assert not fixed.needs_scores and FixedSchedule(4, 0.2).choose(cumulative, 5, 5, True).tolist() == [3, 4, 1, 1, 0]


@pytest.mark.parametrize("seed", range(5))
def test_goodput_width_is_the_exact_optimum_and_each_row_keeps_the_drafts_that_pay_their_input(seed):
    """The width: (L + gain(w)) / t(B, w), every width tried by brute force. Within it a row verifies its drafts
    while q_{b,j} is at least the cost of one input times the rate (a prefix, as q falls along a row)."""
    generator = torch.Generator().manual_seed(seed)
    cumulative = (torch.rand(16, 4, generator=generator) ** (seed + 0.5)).cumprod(1)
    schedule = GoodputSchedule(4, LINEAR)
    rates = [(16 + float(cumulative[:, :w].sum())) / LINEAR.step(16, w) for w in range(5)]
    width, rate = schedule.best_width(cumulative, 16, 16)
    assert width == max(range(5), key=rates.__getitem__) and rate == pytest.approx(max(rates))
    chosen = schedule.choose(cumulative, 16, 16, True)
    expected = (cumulative[:, :width] >= LINEAR.per_input * rate).sum(1)
    assert chosen.tolist() == expected.tolist() and int(chosen.max()) <= width


def test_goodput_chooses_a_plain_step_when_drafts_do_not_pay_and_full_width_when_they_do():
    schedule = GoodputSchedule(4, LINEAR)
    assert schedule.choose(torch.full((8, 4), 0.1).cumprod(1), 8, 8, True).tolist() == [0] * 8
    assert schedule.choose(torch.full((8, 4), 0.97).cumprod(1), 8, 8, True).tolist() == [4] * 8
    rows = torch.tensor([[0.99, 0.98, 0.97]] * 4 + [[0.0, 0.0, 0.0], [0.99, 0.0, 0.0]])  # row 4: no drafts
    assert GoodputSchedule(3, LINEAR).choose(rows, 6, 6, True).tolist() == [3, 3, 3, 3, 0, 1]


def test_only_live_rows_count_in_the_rate():
    """Two rows with likely drafts among eight: where the other six still generate, a plain step commits eight
    tokens and the drafts do not pay for widening every row; where they finished (padding, scores 0), a plain step
    commits two and the same drafts do."""
    scores = torch.zeros(8, 2)
    scores[:2] = torch.tensor([0.9, 0.81])
    assert GoodputSchedule(2, LINEAR).choose(scores, 8, 8, True).tolist() == [0] * 8
    assert GoodputSchedule(2, LINEAR).choose(scores, 8, 2, True).tolist() == [2, 2] + [0] * 6


def test_a_learning_schedule_times_a_plain_step_first_then_verifies_one_draft():
    """No costs yet: the first step is plain (t_plain), the next ones verify each row's first draft (the cheapest
    step that prices every width), and from the learnt costs the choice follows the rate."""
    schedule = GoodputSchedule(3, StepCosts())
    assert schedule.plain_step_due(8) and schedule.wants(8) == (False, False)
    schedule.observe([(step(width=0, proposed=False, proposing=False), [1.0, 0.1])])
    assert schedule.costs.get("plain", 8) == pytest.approx(1.1) and not schedule.plain_step_due(8)
    assert schedule.wants(8) == (True, True)
    scores = torch.tensor([[0.9, 0.8, 0.7]] * 7 + [[0.0, 0.0, 0.0]])
    assert schedule.choose(scores, 8, 8, True).tolist() == [1] * 7 + [0]
    schedule.observe([(step(width=1, drafted=True), [1.5, 0.2])])
    # t_input: the slope of the verifying seconds (1.0 plain, 1.5 with 8 inputs more), not of the plain step's whole
    assert schedule.costs.get("input", 8) == pytest.approx(0.5 / 8) and schedule.costs.get("draft", 8) == 0.2
    assert schedule.choose(scores, 8, 8, True).tolist() == [3] * 7 + [0]


def test_plain_steps_refresh_t_plain_and_costs_follow_the_machine():
    costs = StepCosts(plain=1.0, per_input=0.1, draft=0.05)
    schedule = GoodputSchedule(2, costs)
    schedule.observe([(step(width=0, proposed=False, proposing=False), [8.0, 0.0])])
    for _ in range(PLAIN_REFRESH_STEPS - 1):
        schedule.observe([(step(width=2, accepted=8), [16.0, 0.0])])
        assert not schedule.plain_step_due(8)
    schedule.observe([(step(width=2, accepted=8), [16.0, 0.0])])  # keeps up with plain decoding: no hand-off
    assert schedule.plain_step_due(8) and not schedule.handoff.active
    for _ in range(20):  # the machine runs plain steps at twice the first timing
        schedule.observe([(step(width=0, proposed=False, proposing=False), [16.0, 0.0])])
    assert costs.get("plain", 8) == pytest.approx(16.0, rel=1e-3)
    assert costs.get("plain", 4) == costs.get("plain", 8)  # a batch size never timed: the nearest one timed
    assert StepCosts(plain=1.0, per_input=0.1, draft=0.05).get("plain", 4) == 4.0  # none timed: the prior


def test_wants_stops_drafting_when_it_does_not_pay_and_probes():
    schedule = GoodputSchedule(4, LINEAR)
    assert schedule.wants(8) == (True, True)  # nothing known of what drafting brings: draft
    schedule.choose(torch.full((8, 4), 0.05).cumprod(1), 8, 8, True)
    decisions = [schedule.wants(8)[0] for _ in range(2 * scheduler.PROBE_INTERVAL + 2)]
    assert decisions == ([False] * scheduler.PROBE_INTERVAL + [True]) * 2  # fixed costs: no back-off
    assert all(schedule.wants(8)[1] for _ in range(3))  # free drafts are still proposed
    for _ in range(6):  # the running mean follows the drafts back up
        schedule.choose(torch.full((8, 4), 0.99).cumprod(1), 8, 8, True)
    assert schedule.wants(8) == (True, True)
    schedule.choose(torch.full((8, 4), 0.01).cumprod(1), 8, 8, False)  # free drafts only: not remembered
    assert schedule.wants(8) == (True, True)


# ----- the guard -----------------------------------------------------------------------------------------------------
def test_handoff_once_the_deficit_exceeds_its_bound_with_doubling_backoff():
    guard, plain = HandOff(), 8.0
    excess = 20.0 - (1 + HANDOFF_MARGIN) * 12.0  # 1.5 tokens per row for 2.5x a plain step's time
    first = int((HANDOFF_CREDIT + HANDOFF_LOSS) * plain // excess) + 1  # a call starts with the credit
    for _ in range(first - 1):
        guard.observe(plain, step(accepted=4), 20.0, 0.0)
        assert not guard.active
    guard.observe(plain, step(accepted=4), 20.0, 0.0)
    assert guard.active and guard.plain_steps_left == HANDOFF_BACKOFF and guard.deficit == 0.0
    for _ in range(HANDOFF_BACKOFF):
        guard.observe(plain, step(width=0, proposed=False), 8.0, 0.0)
    assert not guard.active
    for _ in range(int(HANDOFF_LOSS * plain // excess) + 1):  # after a hand-off, from zero
        guard.observe(plain, step(accepted=4), 20.0, 0.0)
    assert guard.plain_steps_left == 2 * HANDOFF_BACKOFF


def test_handoff_deficit_is_floored_so_gains_buy_only_their_credit_and_small_losses_add_up():
    plain = 8.0
    guard = HandOff()
    for _ in range(50):  # 2 tokens per row for 1.5x: ahead, never handed off, credit capped
        guard.observe(plain, step(accepted=8), 12.0, 0.0)
    assert guard.deficit == pytest.approx(-HANDOFF_CREDIT * plain) and not guard.active
    slow = plain * (1 + HANDOFF_MARGIN) + 0.5  # one token per row, half a second slower than the margin allows
    for count in range(1, 100):
        guard.observe(plain, step(num_live=4), slow, 0.0)
        if guard.active:
            break
    assert count == int((HANDOFF_CREDIT + HANDOFF_LOSS) * plain / 0.5) + 1
    streaky = HandOff()  # a winning call whose losses come in streaks: 5 losing steps after every 5 gaining
    for _ in range(20):
        for _ in range(5):
            streaky.observe(plain, step(accepted=12), 12.0, 0.0)
        for _ in range(5):
            streaky.observe(plain, step(), plain * (1 + HANDOFF_MARGIN) + 2.0, 0.0)
    assert streaky.handoffs == 0
    investing = HandOff()
    investing.observe(plain, step(), 8.0, 12.0)  # drafting worth 1.5 plain steps, weighed with the next step
    assert not investing.active and investing.deficit == pytest.approx(12.0 - HANDOFF_CREDIT * plain)
    investing.observe(plain, step(accepted=16), 16.0, 0.0)  # which reaps it: 3 tokens per row in 2 plain steps
    assert not investing.active and investing.deficit < plain


def test_handoff_weighs_a_step_that_verified_nothing_by_its_proposing_only():
    """Steps that had proposals but verified none ran plain forwards: however slowly (the machine's drift), they
    add nothing but the proposing before the next step, and drafting for steps that never verify still hands off."""
    plain = 8.0
    drifted = HandOff()
    for _ in range(100):
        drifted.observe(plain, step(width=0, proposing=False), 12.0, 0.0)
    assert drifted.deficit == -HANDOFF_CREDIT * plain and drifted.handoffs == 0
    drafting = HandOff()
    for count in range(1, 100):
        drafting.observe(plain, step(width=0, drafted=True), 8.0, 1.0)
        if drafting.active:
            break
    assert count == int((HANDOFF_CREDIT + HANDOFF_LOSS) * plain / 1.0) + 2  # the outlay passes the bound, tested next


class SimulatedClock(StepClock):
    """Seconds that depend on a step's work alone, not on the machine's load: B (1 + 0.4 w) per step, 0.1 B for
    drafting (what learnt costs then converge to, whatever else runs beside the test)."""

    def read(self):
        return [(label, [label.batch_size * (1 + 0.4 * label.width), 0.1 * label.batch_size * label.drafted])
                for label, _ in super().read()]


class ConfidentWrongOracle(OracleProposer):
    """An oracle whose drafts are all wrong, with a table that expects 90% of them accepted."""

    def __init__(self, reference_new_tokens: torch.LongTensor, k: int):
        super().__init__((reference_new_tokens + 1) % TINY_VOCAB, k, TINY_VOCAB, PAD)
        self.config = SimpleNamespace(acceptance_table=optimistic_table("confidence"))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_losing_call_goes_over_to_plain_steps_mid_call_and_still_equals_generate(kind, monkeypatch):
    """Speculation that can only lose (every draft rejected, a table that expects 90% accepted), on a simulated
    clock: the guard hands the call off and it runs plain steps, retrying ever more rarely; the greedy output
    (ragged rows, EOS) is still `generate`'s."""
    monkeypatch.setattr(engine, "StepClock", SimulatedClock)
    target = make_target(kind)
    input_ids, mask = make_batch(4, seed=21)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=80)
    new_tokens = reference[:, input_ids.shape[1]:]
    output = assert_same_as_generate(target, ConfidentWrongOracle(new_tokens, 3), input_ids, mask, step_costs=None,
                                     lookup_ngram_size=0, max_new_tokens=80, pad_token_id=PAD,
                                     eos_token_id=int(new_tokens[0, 50]))
    stats = output.speculation_stats
    assert stats.accepted == 0 and stats.drafted > 0 and stats.handoffs >= 1
    assert stats.width_counts[0] > 0.85 * stats.steps, stats.width_counts


class HandOffEverySecondStep(HandOff):
    """A guard that hands off after every second step that verified drafts, whatever the timings."""

    weighed = 0

    def observe(self, plain, timed, seconds, proposing):
        if self.active:
            self.plain_steps_left -= not timed.proposed
            return
        self.weighed += timed.width > 0
        if timed.width and self.weighed % 2 == 0:
            self.plain_steps_left = scheduler.HANDOFF_BACKOFF * 2**self.handoffs
            self.handoffs += 1


class OracleSpecFormer(SpecFormerProposer):
    """The SpecFormer drafter's work (its context cache, deferred through plain steps), with a known continuation's
    tokens as its drafts, so every draft is accepted."""

    def __init__(self, drafter, continuations: torch.LongTensor, vocab_size: int):
        super().__init__(drafter)
        self.oracle = OracleProposer(continuations, self.num_draft_tokens, vocab_size, PAD)

    def propose(self, batch, step, caches, draft=True, free=True) -> Proposal:
        proposal = super().propose(batch, step, caches, draft, free)
        return self.oracle.propose(batch, step, caches) if proposal.drafted else proposal


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_hand_offs_forced_mid_call_keep_the_output_of_generate(kind, monkeypatch):
    """Hand-offs forced every second speculative step, with a back-off of 2 plain steps (then 4, 8, ...): the call
    alternates verification steps and spells of plain steps (the drafter deferred), and the greedy output (ragged
    rows, EOS at different steps) is still `generate`'s."""
    monkeypatch.setattr(scheduler, "HandOff", HandOffEverySecondStep)
    monkeypatch.setattr(scheduler, "HANDOFF_BACKOFF", 2)
    monkeypatch.setattr(engine, "StepClock", SimulatedClock)
    target = make_target(kind)
    input_ids, mask = make_batch(5, seed=8)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=60)
    drafter = OracleSpecFormer(make_drafter(target), reference[:, input_ids.shape[1]:], target.config.vocab_size)
    stats = assert_same_as_generate(target, drafter, input_ids, mask, step_costs=None, max_new_tokens=60,
                                    pad_token_id=PAD, eos_token_id=int(reference[1, input_ids.shape[1] + 20]),
                                    ).speculation_stats
    assert stats.handoffs >= 3 and sum(stats.width_counts[1:]) >= 3, (stats.handoffs, stats.width_counts)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_call_without_step_costs_measures_a_plain_step_first_and_equals_generate(kind):
    """Fresh costs: the call's first steps are plain, it learns from its own steps, and a `StepCosts` kept for the
    next call starts it where this one left off (no plain step needed first)."""
    target = make_target(kind)
    drafter = make_drafter(target)
    input_ids, mask = make_batch(5, seed=4)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    costs = StepCosts()
    kwargs = dict(step_costs=costs, max_new_tokens=30, pad_token_id=PAD,
                  eos_token_id=int(reference[2, input_ids.shape[1] + 12]))  # rows finish at different steps
    stats = assert_same_as_generate(target, drafter, input_ids, mask, **kwargs).speculation_stats
    assert stats.width_counts[0] >= 1 and stats.drafting_steps >= 1
    assert costs.get("plain", 8) is not None and costs.get("input", 8) is not None, costs.learnt
    assert_same_as_generate(target, drafter, input_ids, mask, **kwargs)


def test_fixed_costs_must_be_complete():
    with pytest.raises(ValueError, match="learn=False"):
        StepCosts(plain=1.0, learn=False)
