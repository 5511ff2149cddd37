"""How many drafts a row verifies: a confidence threshold, and the goodput scheduler with its step-cost model."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import make_drafter, make_target
from helpers import PAD, assert_same_as_generate, make_batch, optimistic_table

from hf_specformer import SpecFormerProposer, generate
from hf_specformer.generation.costs import StepCostModel, cached_step_costs, profile_step_costs, step_costs_path
from hf_specformer.generation import costs as costs_module
from hf_specformer.generation import profiling, scheduling
from hf_specformer.generation.forwards import LoopLayers, target_forward
from hf_specformer.generation.profiling import measure_step_costs
from hf_specformer.generation.scheduling import GoodputSchedule, num_drafts_to_verify


def test_longest_prefix_above_threshold_and_at_least_one():
    confidence = torch.tensor([[1.0, 1.0, 0.9, 0.1], [0.5, 0.5, 1.0, 1.0], [0.05, 1.0, 1.0, 1.0], [0.9, 0.1, 1.0, 1.0]])
    # cumulative: [1, 1, .9, .09], [.5, .25, .25, .25], [.05, ...], [.9, .09, .09, .09]
    assert num_drafts_to_verify(confidence, 0.2).tolist() == [3, 4, 1, 1]
    assert num_drafts_to_verify(confidence, 0.0).tolist() == [4, 4, 4, 4]
    assert num_drafts_to_verify(confidence, 1.0).tolist() == [2, 1, 1, 1]


@pytest.mark.parametrize("threshold", [-0.1, 1.5])
def test_generate_rejects_a_threshold_outside_zero_one(threshold):
    target = make_target("llama")
    input_ids, mask = make_batch(2)
    with pytest.raises(ValueError, match="confidence_threshold"):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                 confidence_threshold=threshold, max_new_tokens=3)


# ----- goodput scheduler ----------------------------------------------------------------------------------------
def linear_costs(slope: float = 0.4, draft: float = 0.05, max_width: int = 4) -> StepCostModel:
    """t(B, w) = B (1 + slope w), t_d(B) = draft B."""
    sizes = [1, 8, 64]
    return StepCostModel(sizes, [[b * (1 + slope * w) for w in range(max_width + 1)] for b in sizes],
                         [draft * b for b in sizes])


def brute_force_width(cumulative: torch.Tensor, costs: StepCostModel) -> int:
    batch, k = cumulative.shape
    goodput = [(batch + float(cumulative[:, :w].sum())) / costs.step(batch, w) for w in range(k + 1)]
    return max(range(k + 1), key=goodput.__getitem__)


@pytest.mark.parametrize("seed", range(5))
def test_goodput_width_is_the_exact_optimum(seed):
    generator = torch.Generator().manual_seed(seed)
    per_draft = torch.rand(16, 4, generator=generator) ** (seed + 0.5)
    cumulative = per_draft.cumprod(1)
    costs = linear_costs()
    chosen = GoodputSchedule(costs, 4, packed=False, feedback=False).choose(cumulative)
    assert int(chosen.max()) == brute_force_width(cumulative, costs)
    assert (chosen == chosen.max()).all()  # every row verifies up to the chosen width: it is paid for


@pytest.mark.parametrize("packed", [False, True])
def test_goodput_chooses_a_plain_step_when_drafts_do_not_pay_and_full_width_when_they_do(packed):
    schedule = GoodputSchedule(linear_costs(), 4, packed=packed, feedback=False)
    assert schedule.choose(torch.full((8, 4), 0.1).cumprod(1)).tolist() == [0] * 8
    assert schedule.choose(torch.full((8, 4), 0.97).cumprod(1)).tolist() == [4] * 8


@pytest.mark.parametrize("packed", [False, True])
def test_without_verification_costs_each_row_verifies_one_draft_and_that_step_prices_every_width(packed):
    schedule = GoodputSchedule(None, 3, packed=packed)
    schedule.observe([(("step", 8, 0, [0, 0, 8], False, None), [1.0, 0.0])])  # the call's first step: plain, 1 s
    schedule.stepped(False)
    cumulative = torch.tensor([[0.9, 0.8, 0.7]] * 6 + [[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert schedule.choose(cumulative).tolist() == [1] * 7 + [0]  # not all three: the cheapest step that measures
    schedule.observe([(("step", 8, 1, [7, 7, 8], True, True), [1.7, 0.2])])
    assert schedule.costs.verify_known
    assert schedule.costs.verify(8, 8 + 14) == pytest.approx(1.0 + 2 * 0.7)  # 14 drafts: twice the 7 timed


@pytest.mark.parametrize("packed", [False, True])
def test_rows_without_drafts_verify_none(packed):
    confident = [0.99, 0.98, 0.97]
    cumulative = torch.tensor([confident] * 4 + [[0.0, 0.0, 0.0], [0.99, 0.0, 0.0]])  # row 4: no draft at all
    schedule = GoodputSchedule(linear_costs(max_width=3), 3, packed=packed, feedback=False)
    assert schedule.choose(cumulative).tolist() == [3, 3, 3, 3, 0, 1]


def brute_force_packed(cumulative: torch.Tensor, schedule: GoodputSchedule) -> float:
    """The best rate over every choice of a prefix per row (all (k + 1)^B of them)."""
    batch, k = cumulative.shape
    best = 0.0
    for counts in itertools.product(range(k + 1), repeat=batch):
        gain = sum(float(cumulative[b, :n].sum()) for b, n in enumerate(counts))
        seconds = schedule.packed_step_seconds(batch, torch.tensor(float(batch + sum(counts))), max(counts))
        best = max(best, (batch + gain) / float(seconds))
    return best


@pytest.mark.parametrize("seed", range(5))
def test_packed_goodput_is_the_best_choice_of_row_prefixes(seed):
    """The batch greedy over (row, draft) candidates, under each rectangle width, reaches the best rate of all per-row
    prefix choices (priced with their rectangle), and it gives rows different counts where their estimates differ."""
    generator = torch.Generator().manual_seed(seed)
    cumulative = (torch.rand(4, 3, generator=generator) ** 0.3).cumprod(1)
    schedule = GoodputSchedule(linear_costs(slope=0.3 + 0.1 * seed, max_width=3), 3, feedback=False)
    counts = schedule.choose(cumulative)
    gain = sum(float(cumulative[b, :n].sum()) for b, n in enumerate(counts.tolist()))
    seconds = schedule.packed_step_seconds(4, torch.tensor(4.0 + float(counts.sum())), int(counts.max()))
    rate = (4 + gain) / float(seconds)
    assert rate == pytest.approx(brute_force_packed(cumulative, schedule))


def test_packed_goodput_verifies_only_the_likely_drafts_of_each_row():
    cumulative = torch.tensor([[0.95, 0.9, 0.85], [0.2, 0.1, 0.05], [0.95, 0.3, 0.1], [0.9, 0.85, 0.8]])
    schedule = GoodputSchedule(linear_costs(max_width=3), 3, feedback=False)
    assert schedule.choose(cumulative).tolist() == [3, 0, 2, 3]  # row 2's third draft: not worth an input


def test_packed_goodput_prices_the_rectangle_a_single_long_row_widens(monkeypatch):
    """One row's three confident drafts would widen the rectangle of all eight rows from one input to four. Priced
    by its verified inputs alone, that step looks cheap and is taken; priced with its unverified inputs at
    `RECTANGLE_WEIGHT` it does not pay, and a plain step is. The same drafts on every row verify in full."""
    lone = torch.tensor([[0.95, 0.9, 0.85]] + [[0.3, 0.1, 0.0]] * 7)
    every_row = torch.tensor([[0.95, 0.9, 0.85]] * 8)
    schedule = GoodputSchedule(linear_costs(slope=0.4, max_width=3), 3, feedback=False)
    assert schedule.choose(lone).tolist() == [0] * 8
    assert schedule.choose(every_row).tolist() == [3] * 8
    monkeypatch.setattr(scheduling, "RECTANGLE_WEIGHT", 0.0)
    assert schedule.choose(lone).tolist() == [3] + [0] * 7


def test_packed_step_cost_interpolates_between_widths_and_ignores_noise():
    costs = StepCostModel([1, 8], [[1.0, 0.5, 3.0], [8.0, 12.0, 16.0]], [0.1, 0.8])  # B = 1: w = 1 measured too low
    schedule = GoodputSchedule(costs, 2, feedback=False)
    seconds = schedule.packed_step_seconds(8, torch.tensor([8.0, 12.0, 16.0, 20.0, 24.0]), 2)
    # priced at T + (24 - T) / 2 inputs (half of the unverified rectangle): 8 (plain), 18, 20, 22, 24
    assert seconds.tolist() == pytest.approx([8.0, 13.0, 14.0, 15.0, 16.0])
    assert schedule.packed_step_seconds(8, torch.tensor([12.0, 16.0]), 1).tolist() == pytest.approx([11.0, 12.0])
    assert schedule.step_seconds(1).tolist() == [1.0, 1.0, 3.0]


def test_should_draft_stops_when_drafting_does_not_pay_and_probes():
    schedule = GoodputSchedule(linear_costs(), 4, probe_interval=3, feedback=False)
    assert schedule.should_draft(8)  # nothing known yet: draft
    schedule.choose(torch.full((8, 4), 0.05).cumprod(1))
    decisions = [schedule.should_draft(8) for _ in range(8)]
    assert decisions == [False, False, False, True, False, False, False, True]
    for _ in range(6):  # the running mean follows the drafts back up
        schedule.choose(torch.full((8, 4), 0.99).cumprod(1))
    assert schedule.should_draft(8)
    schedule.choose(torch.full((8, 4), 0.01).cumprod(1), drafted=False)  # lookup-only: not remembered
    assert schedule.should_draft(8)


def test_step_cost_model_interpolates_extrapolates_and_round_trips(tmp_path):
    costs = StepCostModel([1, 4, 16], [[1.0, 2.0], [4.0, 6.0], [16.0, 20.0]], [0.1, 0.4, 1.6])
    assert costs.step(2, 0) == pytest.approx(2.0) and costs.step(10, 1) == pytest.approx(13.0)
    assert costs.step(32, 0) == pytest.approx(32.0) and costs.draft(8) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="width"):
        costs.step(4, 2)
    costs.save(tmp_path / "costs.json")
    assert StepCostModel.load(tmp_path / "costs.json") == costs
    assert StepCostModel.from_value(str(tmp_path / "costs.json")) == costs
    (tmp_path / "bad.json").write_text("{\"batch_sizes\": [1]}")
    with pytest.raises(ValueError, match="step-cost file"):
        StepCostModel.load(tmp_path / "bad.json")


def test_cached_step_costs_measure_once_per_description_and_again_for_larger_batches():
    calls = []

    def measure(sizes, width):
        calls.append((sizes, width))
        return StepCostModel(sizes, [[float(b) * (1 + w) for w in range(width + 1)] for b in sizes],
                             [0.0] * len(sizes))

    description = {"model": "test", "seed": 17}
    first = cached_step_costs(description, 6, 3, measure)
    again = cached_step_costs(description, 8, 2, measure)
    assert first == again and calls == [([1, 2, 4, 8], 3)]
    cached_step_costs(description, 100, 3, measure)
    assert calls[-1] == ([1, 2, 4, 8, 16, 32, 64, 128], 3)
    step_costs_path(description).write_text("not json")
    cached_step_costs(description, 2, 1, measure)  # an unreadable cache file is measured anew
    assert len(calls) == 3


def test_profile_takes_the_median_of_timed_rounds_after_a_warm_up(monkeypatch):
    """On a clock that only the work advances: every width, drafting and the plain step get their own cost per
    batch size; the untimed warm-up round (100 s) and one slow round (+1 s) do not move the medians."""
    clock = {"now": 0.0, "calls": 0}
    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: clock["now"])

    def work(seconds: float):
        clock["calls"] += 1
        warm_up = clock["calls"] <= len(WORK)
        clock["now"] += seconds + (100.0 if warm_up else 0.0) + (1.0 if clock["calls"] == 2 * len(WORK) else 0.0)

    WORK = ["w0", "w1", "w2", "draft", "plain"]
    measured = profile_step_costs(lambda b, w: work(0.002 * (w + 1) * b), lambda b: work(0.001 * b), [1], 2,
                                  repeats=3, plain=lambda b: work(0.0015 * b))
    assert measured.step_seconds == [pytest.approx([0.002, 0.004, 0.006])]
    assert measured.draft_seconds == [pytest.approx(0.001)] and measured.plain_seconds == [pytest.approx(0.0015)]


def test_measured_step_costs_time_the_loops_forwards(monkeypatch):
    """The engine's own measurement on a tiny target times what the loop runs: at each batch size a target forward
    of w + 1 inputs per row for every width, sped up (few-row products on) and recording the hidden states the
    drafter reads, and plain decoding's forward of one input per row, sped up as well (`_plain_decode` runs with the
    CPU speed-ups) and recording nothing; every cost is in seconds."""
    target = make_target("llama")
    drafter = make_drafter(target)
    layers = LoopLayers(target, [target, drafter])
    seen = set()

    def recording_forward(model, input_ids, attention_mask, position_ids, cache, hidden_state_indices, *args):
        seen.add((tuple(input_ids.shape), frozenset(hidden_state_indices), layers.linears.few_rows_on))
        return target_forward(model, input_ids, attention_mask, position_ids, cache, hidden_state_indices, *args)

    monkeypatch.setattr(profiling, "target_forward", recording_forward)
    costs = measure_step_costs(target, SpecFormerProposer(drafter, 3), layers, [1, 4], 3)
    hooked = frozenset(drafter.config.hook_layers)
    loop = {((b, w + 1), hooked, True) for b in (1, 4) for w in range(4)}
    plain = {((b, 1), frozenset(), True) for b in (1, 4)}
    assert seen == loop | plain, seen ^ (loop | plain)
    assert costs.batch_sizes == [1, 4] and len(costs.plain_seconds) == 2 and len(costs.draft_seconds) == 2
    assert all(len(row) == 4 for row in costs.step_seconds)
    assert all(0 < t < 1 for t in [*costs.plain_seconds, *costs.draft_seconds, *sum(costs.step_seconds, [])])


def test_speculation_pays_only_where_the_engine_beats_plain_decoding():
    costs = linear_costs(slope=0.4, draft=0.05)
    assert GoodputSchedule(costs, 4, feedback=False).speculation_pays(64)  # nothing known: speculate
    weak = GoodputSchedule(costs, 4, expected_accepted=[0.0, 0.3, 0.4, 0.45, 0.47], feedback=False)
    strong = GoodputSchedule(costs, 4, expected_accepted=[0.0, 0.9, 1.7, 2.4, 3.0], feedback=False)
    assert not weak.speculation_pays(64) and strong.speculation_pays(64)
    slow_plain = StepCostModel(costs.batch_sizes, costs.step_seconds, costs.draft_seconds,
                               plain_seconds=[1.3 * b for b in costs.batch_sizes])
    weak_slow_plain = GoodputSchedule(slow_plain, 4, expected_accepted=[0.0, 0.3, 0.4, 0.45, 0.47], feedback=False)
    assert weak_slow_plain.speculation_pays(64)
    # an engine faster than plain decoding at width 0 (CPU patches, or noise) but whose drafts never pay: plain
    hopeless = GoodputSchedule(slow_plain, 4, expected_accepted=[0.0, 0.05, 0.06, 0.07, 0.08], feedback=False)
    assert not hopeless.speculation_pays(64)
    short = GoodputSchedule(costs, 4, expected_accepted=[0.0, 0.9], feedback=False)  # extended with its last value
    assert short.expected.tolist() == [0.0, 0.9, 0.9, 0.9, 0.9]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_call_where_no_width_pays_runs_plain_decoding(kind):
    """Calibrated gains too small for the batch's step costs: transformers' own loop runs (same tokens, no
    drafter), and the statistics say so."""
    target = make_target(kind)
    drafter = make_drafter(target)
    table = optimistic_table("confidence")
    table["expected_accepted"] = [0.0, 0.05, 0.08, 0.1]
    drafter.config.acceptance_table = table
    input_ids, mask = make_batch(6, seed=9)
    output = assert_same_as_generate(target, drafter, input_ids, mask, max_new_tokens=12, pad_token_id=PAD)
    stats = output.speculation_stats
    assert stats.plain_decoding and stats.steps == 12 and stats.width_counts[0] == 12 and stats.drafted == 0


def test_learnt_costs_merge_into_the_cached_ones_by_batch_size():
    older = StepCostModel([1, 8], [[1.0, 2.0], [8.0, 16.0]], [0.1, 0.8], [1.0, 8.0])
    newer = StepCostModel([4, 8], [[3.0, 5.0], [9.0, 18.0]], [0.3, 0.9], [3.0, 9.0])
    merged = newer.merged_into(older)
    assert merged.batch_sizes == [1, 4, 8] and merged.step_seconds == [[1.0, 2.0], [3.0, 5.0], [9.0, 18.0]]
    assert merged.draft_seconds == [0.1, 0.3, 0.9] and merged.plain_seconds == [1.0, 3.0, 9.0]
    assert newer.merged_into(None) is newer
    assert newer.merged_into(StepCostModel([1], [[1.0, 2.0, 3.0]], [0.1], [1.0])) is newer  # other widths
