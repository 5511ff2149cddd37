"""The ragged batch's bookkeeping: compaction, finished rows kept as padding, admissions (each rule alone; the engine
tests check them end to end against `generate`)."""

from __future__ import annotations

import torch
from helpers import PAD, make_batch, started_batch

from hf_specformer.generation.batch import Admissions, RaggedBatch, padded_batch_size


def _two_row_batch() -> RaggedBatch:
    """Row 0: one padding column and 2 prompt tokens, then a step of 3 inputs of which 1 is kept; row 1: 3 prompt
    tokens and all 3 inputs kept. Masks [0 1 1 1 0 0] and [1 1 1 1 1 1]."""
    batch = started_batch(torch.tensor([[PAD, 5, 6], [4, 5, 6]]), torch.tensor([[0, 1, 1], [1, 1, 1]]), 8, PAD)
    batch.step_mask(torch.ones(2, 3, dtype=torch.long))
    batch.commit_cache(torch.tensor([1, 3]), 3)
    batch.max_length = int(batch.lengths.max())
    return batch


def test_compaction_right_aligns_each_rows_valid_columns_in_order():
    batch = _two_row_batch()
    assert batch.lengths.tolist() == [3, 6] and batch.removable_fraction() == 0.0
    columns = torch.arange(6).expand(2, 6)  # a cache whose entry at column c holds c
    index = batch.compaction_index()
    batch.compact(index)
    assert batch.attention_mask.tolist() == [[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    kept = columns.gather(1, index)
    assert kept[0, 3:].tolist() == [1, 2, 3] and kept[1].tolist() == [0, 1, 2, 3, 4, 5]


def test_compaction_after_the_longest_row_left_removes_the_shared_holes():
    """Once row 1 is dropped, half the columns are holes of every remaining row: compaction squeezes them out once
    the next step's read has the longest length (the one read before the drop is an upper bound)."""
    batch = _two_row_batch()
    batch.select_rows([0])
    assert batch.removable_fraction() == 0.0
    batch.max_length = int(batch.lengths.max())
    assert batch.removable_fraction() == 0.5
    index = batch.compaction_index()
    batch.compact(index)
    assert index.tolist() == [[1, 2, 3]] and batch.attention_mask.tolist() == [[1, 1, 1]]


def test_padded_batch_size():
    assert [padded_batch_size(n) for n in range(11)] == [0, 1, 2, 4, 4, 8, 8, 8, 8, 16, 16]
    assert [padded_batch_size(n) for n in (17, 24, 25, 64)] == [24, 24, 32, 64]


def test_rows_to_keep_keeps_finished_rows_as_padding_up_to_the_padded_size():
    batch = started_batch(torch.ones(8, 2, dtype=torch.long), None, capacity=4, pad_token_id=PAD)
    for finished, kept in (([0, 1, 0, 0, 1, 0, 0, 0], None),  # 6 live: stays at 8
                           ([0, 1, 1, 0, 1, 1, 0, 1], [0, 1, 3, 6]),  # 3 live: 4 rows, the first finished one
                           ([1] * 8, [])):
        batch.host_finished, batch.num_live = [bool(f) for f in finished], finished.count(0)
        assert batch.rows_to_keep() == kept


def test_a_batch_left_without_rows_keeps_no_columns():
    batch = started_batch(*make_batch(3, seed=1), capacity=8)
    batch.select_rows([])
    assert batch.size == 0 and batch.attention_mask.shape == (0, 0) and batch.host_rows == []


def test_admissions_wait_for_an_eighth_of_the_slots_then_fill_every_free_one():
    admissions = Admissions(20, slots=16)  # 20 rows, 16 slots: at least 2 free to admit
    assert admissions.due(0) == list(range(16))
    assert admissions.due(15) == []
    assert admissions.due(14) == [16, 17]
    assert admissions.due(13) == [18, 19]  # fewer waiting than free slots
    assert admissions.due(0) == []
    small = Admissions(3, slots=2)
    assert small.due(0) == [0, 1] and small.due(1) == [2]


def test_an_admission_holds_its_rows_longest_prompt_and_joins_by_column():
    """Rows with 2 and 4 real prompt tokens are prefilled over 4 columns; joined to a running row of 6 columns,
    their mask is padded with hidden columns on the right."""
    input_ids = torch.tensor([[PAD] * 4 + [5, 6], [PAD, PAD, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
    mask = (input_ids != PAD).long()
    batch = RaggedBatch.start(input_ids, mask, 8, 8, slots=3, capacity=20, pad_token_id=PAD)
    running = batch.admission([2])
    running.commit_prompt()
    batch.join(running)
    new = batch.admission([0, 1])
    assert new.columns == 4 and new.prompt_ids().tolist() == [[PAD, PAD, 5, 6], [3, 4, 5, 6]]
    new.commit_prompt()
    batch.join(new)
    assert batch.attention_mask.tolist() == [[1] * 6, [0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert batch.lengths.tolist() == [6, 2, 4] and batch.host_rows == [2, 0, 1]


def test_prefill_groups_keep_each_prefills_padding_under_half():
    """Prompts of 2, 40, 30, 3 and 19 tokens: 40 and 30 share a prefill, 19 has its own, 3 and 2 share one (each
    group in the order given)."""
    lengths = [2, 40, 30, 3, 19]
    input_ids = torch.tensor([[PAD] * (40 - n) + [5] * n for n in lengths])
    batch = RaggedBatch.start(input_ids, (input_ids != PAD).long(), 8, 8, slots=5, capacity=60, pad_token_id=PAD)
    assert batch.prefill_groups([0, 1, 2, 3, 4]) == [[1, 2], [4], [0, 3]]
    assert batch.admission([0, 3]).columns == 3
