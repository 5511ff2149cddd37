"""Continuous batching: rows admitted into the running batch as others finish give `generate`'s output."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_ONLY, make_drafter, make_target
from helpers import PAD, assert_same_as_generate, make_batch, started_batch

from hf_specformer import SpecFormerProposer, generate, generate_batch
from hf_specformer.generation.admission import VOCABULARY_COPIES, Admissions, slot_bytes
from hf_specformer.generation.caching import PreallocatedCache, cache_capacity, kv_bytes_per_column
from hf_specformer.generation.speculation import SpeculationConfig
from hf_specformer.generation.costs import StepCostModel
from hf_specformer.generation.forwards import cache_argument


def test_admissions_wait_for_an_eighth_of_the_slots_then_fill_every_free_one():
    admissions = Admissions([3, 5, 2, 7] * 5, slots=16)  # 20 rows, 16 slots: at least 2 free to admit
    assert admissions.due(0) == list(range(16))
    assert admissions.due(15) == []
    assert admissions.due(14) == [16, 17]
    assert admissions.width([16, 17]) == 5 and admissions.width([18]) == 2
    assert admissions.due(13) == [18, 19]  # fewer waiting than free slots
    assert admissions.due(0) == []
    small = Admissions([4, 4, 4], slots=2)
    assert small.due(0) == [0, 1] and small.due(1) == [2]


def test_rows_appended_to_a_cache_keep_their_columns_and_pad_with_zeros():
    """A cache of 3 rows (its buffers' rows) keeps 2 of 5 columns, then + [1 row, 3 columns] -> 3 rows of 5, the
    new row's last 2 zero; keeps 2 again, then + [1 row, 7 columns] -> 3 rows of 7, the older rows' last 2 zero."""
    cache, part, longer = (PreallocatedCache(num_layers=1, capacity=8) for _ in range(3))
    start = torch.randn(3, 1, 5, 4)
    cache.update(start, start, 0)
    cache.batch_select_indices(torch.tensor([0, 2]))
    first = torch.randn(1, 1, 3, 4)
    part.update(first, first, 0)
    cache.append_rows(part)
    keys = cache.layers[0].keys
    assert keys.shape == (3, 1, 5, 4) and torch.equal(keys[:2], start[[0, 2]])
    assert torch.equal(keys[2, :, :3], first[0]) and not keys[2, :, 3:].any()
    second = torch.randn(1, 1, 7, 4)
    longer.update(second, second, 0)
    with pytest.raises(RuntimeError, match="rows"):  # the buffers hold as many rows as the first forward had
        cache.append_rows(longer)
    cache.batch_select_indices(torch.tensor([0, 2]))
    cache.append_rows(longer)
    keys = cache.layers[0].keys
    assert keys.shape == (3, 1, 7, 4) and torch.equal(keys[2], second[0]) and not keys[:2, :, 5:].any()
    assert torch.equal(keys[0, :, :5], start[0]) and torch.equal(keys[1, :, :3], first[0])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("max_batch_size", [1, 3, 5])
@pytest.mark.parametrize("schedule", ["goodput", "fixed"])
def test_rows_admitted_mid_call_give_the_output_of_generate(kind, max_batch_size, schedule):
    """9 ragged prompts through 1, 3 or 5 slots (rows join as others finish: at EOS, at different steps, or at
    max_new_tokens), with the drafter and prompt lookup, caches compacted whenever holes appear: every row equals
    plain `generate` of the whole batch, and no step held more rows than the slots."""
    target = make_target(kind)
    drafter = make_drafter(target)
    input_ids, mask = make_batch(9, seed=31)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    stats = assert_same_as_generate(
        target, drafter, input_ids, mask, schedule=schedule, max_new_tokens=24, pad_token_id=PAD,
        eos_token_id=int(reference[2, input_ids.shape[1] + 6]), compaction_hole_fraction=0.0,
        max_batch_size=max_batch_size,
    ).speculation_stats
    assert stats.row_steps <= max_batch_size * stats.steps, (stats.row_steps, stats.steps)
    assert stats.drafted > 0


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_admissions_keep_prefix_processors_and_suffix_drafts_lossless(kind):
    """Prefix-reading processors (repetition penalty, min_new_tokens) and suffix drafts across rows admitted at
    different times: still `generate`'s output (stop strings and EOS with admissions: `test_properties.py`)."""
    target = make_target(kind)
    drafter = make_drafter(target)
    input_ids, mask = make_batch(7, seed=5)
    assert_same_as_generate(
        target, drafter, input_ids, mask, max_new_tokens=20, pad_token_id=PAD, repetition_penalty=1.3,
        min_new_tokens=6, suffix_index=True, max_batch_size=2,
    )


def test_max_batch_size_must_be_a_positive_int():
    target = make_target()
    drafter = make_drafter(target)
    input_ids, mask = make_batch(3, seed=1)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="max_batch_size"):
            generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=drafter, max_batch_size=bad)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_continuous_batching_without_drafts_equals_generate(kind):
    """k = 0 with fewer slots than rows: plain steps in the engine, rows admitted as others finish (and no drafter
    work: `NoDrafts`); `generate_batch` without a drafter runs the same way."""
    target = make_target(kind)
    input_ids, mask = make_batch(7, seed=8)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    eos = int(reference[2, input_ids.shape[1] + 4])
    output = assert_same_as_generate(target, make_drafter(target), input_ids, mask, num_draft_tokens=0,
                                     max_batch_size=3, max_new_tokens=12, eos_token_id=eos, pad_token_id=PAD)
    stats = output.speculation_stats
    assert not stats.plain_decoding and stats.drafted == 0 and stats.width_counts == [stats.steps]
    prompts = [row[m.bool()].tolist() for row, m in zip(input_ids, mask)]
    outputs = generate_batch(target, prompts, max_batch_size=3, max_new_tokens=12, eos_token_id=eos,
                             pad_token_id=PAD, do_sample=False, progress_bar=False)
    for output, row in zip(outputs, reference[:, input_ids.shape[1]:].tolist()):
        end = row.index(eos) + 1 if eos in row else 12
        assert output.generated_tokens == row[:end] and output.tokens_per_step == 1.0


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_generate_batch_returns_each_requests_own_greedy_answer_and_why_it_ended(kind):
    """7 requests of different lengths through 3 slots: each request's tokens equal plain `generate` of its prompt
    alone (cut after its EOS), with finish reason "eos" where it ended on one and "length" at max_new_tokens."""
    target = make_target(kind)
    drafter = make_drafter(target)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (length,), generator=generator).tolist() for length in (3, 9, 5, 12, 4, 7, 6)]
    alone = [target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, pad_token_id=PAD)[0,
                                                                                                        len(prompt):]
             for prompt in prompts]
    eos = int(alone[1][5])
    outputs = generate_batch(target, prompts, assistant_model=drafter, max_batch_size=3, max_new_tokens=16,
                             eos_token_id=eos, pad_token_id=PAD, do_sample=False)
    reasons = []
    for prompt, output, reference in zip(prompts, outputs, alone):
        ends = (reference == eos).nonzero().flatten().tolist()
        expected = reference[: ends[0] + 1] if ends else reference
        assert output.prompt_ids == prompt and output.generated_tokens == expected.tolist()
        assert output.finish_reason == ("eos" if ends else "length") and output.tokens_per_step >= 1.0
        reasons.append(output.finish_reason)
    assert "eos" in reasons and "length" in reasons


def test_generate_batch_rejects_empty_requests():
    target = make_target()
    for bad in ([], [[3, 4], []], [torch.tensor([3, 4])]):
        with pytest.raises(ValueError, match="token-id lists"):
            generate_batch(target, bad, assistant_model=make_drafter(target))


@pytest.mark.parametrize("slots", [None, 2])
def test_each_row_is_reported_once_the_step_it_finishes(slots):
    """`row_finished` gets every row once, with the tokens `generate` returns for it and the steps and accepted
    drafts the call counted for it; reports come as rows finish (rows of one admission in order of their steps), not
    in row order at the end."""
    target = make_target()
    input_ids, mask = make_batch(6, seed=5)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    eos = int(reference[0, input_ids.shape[1] + 3])  # row 0 ends early, others later or never
    reports = []
    output = generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                      schedule="fixed", max_new_tokens=24, eos_token_id=eos, pad_token_id=PAD,
                      max_batch_size=slots, return_dict_in_generate=True, row_finished=reports.append)
    assert sorted(report.row for report in reports) == list(range(6))
    generated = output.sequences[:, input_ids.shape[1]:]
    for report in reports:
        row = generated[report.row].tolist()
        assert report.tokens == row[: len(report.tokens)] and all(t == PAD for t in row[len(report.tokens):])
        assert report.tokens[-1] == eos or len(report.tokens) == 24
        kappa = output.speculation_stats.tokens_per_row_step[report.row]
        assert report.steps > 0 and (report.steps + report.accepted) / report.steps == pytest.approx(kappa)
    if slots is None:  # one admission: finishing order is the order of steps taken
        assert [report.steps for report in reports] == sorted(report.steps for report in reports)
        assert [report.row for report in reports] != list(range(6))


def test_rows_of_transformers_own_loop_are_reported_at_the_end():
    """k = 0 runs transformers' loop: every row is reported after it, cut after its EOS."""
    target = make_target()
    input_ids, mask = make_batch(3, seed=2)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    eos = int(reference[1, input_ids.shape[1] + 2])
    reports = []
    output = generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                      num_draft_tokens=0, max_new_tokens=12, eos_token_id=eos, pad_token_id=PAD,
                      row_finished=reports.append)
    assert [report.row for report in reports] == [0, 1, 2]
    for report, row in zip(reports, output[:, input_ids.shape[1]:].tolist()):
        end = row.index(eos) + 1 if eos in row else 12
        assert report.tokens == row[:end] and report.accepted == 0


def test_generate_batch_hands_over_outputs_as_they_finish_and_an_interruption_keeps_them():
    """`on_output` sees each request's final output; when it raises (a job killed mid-call), the call stops there
    and what it was handed stays correct."""
    target = make_target()
    drafter = make_drafter(target)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 90, (length,), generator=generator).tolist() for length in (4, 8, 3, 6, 5, 9)]
    kwargs = dict(assistant_model=drafter, max_batch_size=2, max_new_tokens=10, pad_token_id=PAD, do_sample=False)
    outputs = generate_batch(target, prompts, **kwargs)
    seen = {}

    def stop_after_three(index, output):
        seen[index] = output
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_batch(target, prompts, on_output=stop_after_three, progress_bar=False, **kwargs)
    assert len(seen) == 3
    for index, output in seen.items():  # the steps taken depend on the timings the scheduler learns from
        assert (output.prompt_ids, output.generated_tokens, output.finish_reason) == \
            (outputs[index].prompt_ids, outputs[index].generated_tokens, outputs[index].finish_reason)


@CPU_ONLY
def test_rows_admitted_after_the_batch_emptied_start_from_fresh_columns():
    """Every running row finishes on the same step while the drafter's work is deferred (plain steps: drafting never
    pays at these costs), so the batch empties with the drafter's cache behind the target's; the rows admitted next
    start from their own columns in every cache, and each answer is still `generate`'s."""
    target = make_target()
    generator = torch.Generator().manual_seed(6)
    same, *others = [torch.randint(3, 90, (length,), generator=generator) for length in (7, 3, 9)]
    prompts = [same, same, *others]  # the first two finish together; the next two, of other lengths, join together
    input_ids = torch.stack([torch.cat([torch.full((9 - len(p),), PAD), p]) for p in prompts])
    mask = (torch.arange(9)[None, :] >= torch.tensor([9 - len(p) for p in prompts])[:, None]).long()
    costly_drafts = StepCostModel(batch_sizes=[1, 64], step_seconds=[[1.0] + [100.0] * 8, [64.0] + [6400.0] * 8],
                                  draft_seconds=[100.0, 6400.0])
    assert_same_as_generate(target, make_drafter(target), input_ids, mask, max_new_tokens=14, pad_token_id=PAD,
                            max_batch_size=2, step_costs=costly_drafts, cost_feedback=False)


def test_a_batch_left_without_rows_keeps_no_columns():
    batch = started_batch(*make_batch(3, seed=1), capacity=8)
    batch.select_rows(torch.tensor([], dtype=torch.long))
    assert batch.size == 0 and batch.attention_mask.shape == (0, 0)
    cache = PreallocatedCache(num_layers=1, capacity=8)
    cache.update(torch.ones(3, 2, 5, 4), torch.ones(3, 2, 5, 4), 0)
    cache.batch_select_indices(torch.tensor([], dtype=torch.long))
    assert cache.columns == 0


def _buffer_bytes(cache: PreallocatedCache) -> int:
    return sum(layer.key_buffer.nbytes + layer.value_buffer.nbytes for layer in cache.layers)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_slot_bytes_are_the_bytes_the_caches_allocate_per_row(kind):
    """The target's and the drafter's preallocated caches, filled by real forwards of 3 rows, hold exactly
    3 x capacity x the bytes per column that `slot_bytes` counts; the rest of a slot is its logits and the prefill
    states recorded (the drafter's hooked layers and the last)."""
    target = make_target(kind)
    proposer = SpecFormerProposer(make_drafter(target), num_draft_tokens=3)
    config = target.config.get_text_config()
    input_ids, mask = make_batch(3, seed=2)
    width, max_new_tokens = input_ids.shape[1], 10
    capacity = cache_capacity(width, max_new_tokens, 3)
    cache = PreallocatedCache(config.num_hidden_layers, capacity)
    output = target(input_ids=input_ids, attention_mask=mask, **cache_argument(target, cache), output_hidden_states=True)
    proposer.start(capacity)
    hooked = torch.stack([output.hidden_states[i] for i in proposer.drafter.config.hook_layers], dim=2)
    proposer.drafter(hooked, past_key_values=proposer.cache, return_logits=False)
    target_per_column = kv_bytes_per_column(config, config.num_hidden_layers, target.dtype)
    assert _buffer_bytes(cache) == 3 * capacity * target_per_column
    assert _buffer_bytes(proposer.cache) == 3 * capacity * proposer.cache_bytes_per_column() > 0
    recorded = set(proposer.drafter.config.hook_layers) | {config.num_hidden_layers}  # the drafter's and the last
    rest = VOCABULARY_COPIES * 4 * config.vocab_size * 8 + len(recorded) * width * config.hidden_size * 8
    assert slot_bytes(target, proposer, width, max_new_tokens) == \
        capacity * (target_per_column + proposer.cache_bytes_per_column()) + rest


def test_a_memory_budget_caps_the_slots_at_what_fits():
    config = SpeculationConfig(max_batch_size=8, memory_budget=3500)
    assert config.slots(20, 1000) == 3 and config.slots(2, 1000) == 2
    assert SpeculationConfig(max_batch_size=2, memory_budget=3500).slots(20, 1000) == 2
    assert SpeculationConfig(memory_budget=3500).slots(20, 1000) == 3
    with pytest.raises(ValueError, match="holds no row"):
        config.slots(20, 4000)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="memory_budget"):
            SpeculationConfig(memory_budget=bad)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_rows_under_a_memory_budget_give_the_output_of_generate(kind):
    """A budget of two and a half slots (2 rows decoded at once, the others admitted as rows finish) keeps every
    row equal to plain `generate`; a budget below one slot is refused."""
    target = make_target(kind)
    drafter = make_drafter(target)
    input_ids, mask = make_batch(7, seed=4)
    one_slot = slot_bytes(target, SpecFormerProposer(drafter, num_draft_tokens=4), input_ids.shape[1], 12)
    assert_same_as_generate(target, drafter, input_ids, mask, num_draft_tokens=4, max_new_tokens=12,
                            pad_token_id=PAD, memory_budget=int(2.5 * one_slot))
    with pytest.raises(ValueError, match="holds no row"):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=drafter, num_draft_tokens=4,
                 max_new_tokens=12, pad_token_id=PAD, memory_budget=one_slot - 1)
