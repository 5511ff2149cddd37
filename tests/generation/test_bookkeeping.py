"""Unit tests of the engine's bookkeeping helpers: compaction of ragged caches, committing tokens, processing logits
over ragged prefixes. (The engine tests check them end to end against `generate`; these pin each rule alone.)"""

from __future__ import annotations

import torch
from helpers import PAD, started_batch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from hf_specformer.generation.batch import RaggedBatch
from hf_specformer.generation.committing import Committer
from hf_specformer.generation.processing import RaggedLogitsProcessor



def _two_row_batch() -> RaggedBatch:
    """Row 0: one padding column and 2 prompt tokens, then a step of 3 inputs of which 1 is kept; row 1: 3 prompt
    tokens and all 3 inputs kept. Masks [0 1 1 1 0 0] and [1 1 1 1 1 1]."""
    batch = started_batch(torch.tensor([[PAD, 5, 6], [4, 5, 6]]), torch.tensor([[0, 1, 1], [1, 1, 1]]), 8, PAD)
    batch.commit_prompt()
    batch.commit_cache(torch.tensor([1, 3]), 3)
    batch.refresh(torch.Tensor.cpu)
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
    """Once row 1 is dropped, half the columns are holes of every remaining row: compaction squeezes them out (the
    longest length read before the drop is an upper bound, so it keeps every valid column)."""
    batch = _two_row_batch()
    batch.select_rows(torch.tensor([0]))
    batch.refresh(torch.Tensor.cpu)
    assert batch.removable_fraction() == 0.5
    index = batch.compaction_index()
    batch.compact(index)
    assert index.tolist() == [[1, 2, 3]] and batch.attention_mask.tolist() == [[1, 1, 1]]


def _generation_config(eos: int) -> GenerationConfig:
    config = GenerationConfig(eos_token_id=eos, pad_token_id=PAD)
    config._eos_token_tensor, config._pad_token_tensor = torch.tensor([eos]), torch.tensor(PAD)
    return config


class StopAfterSeven(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == 7


def test_committer_cuts_rows_at_eos_at_max_new_tokens_and_at_a_stopping_criterion():
    batch = started_batch(torch.full((5, 2), 5), None, 8, PAD)
    batch.num_generated[3] = 3  # two new tokens left of max_new_tokens = 5
    batch.finished[4] = True  # already finished: commits nothing
    commit = Committer(StoppingCriteriaList([StopAfterSeven()]), _generation_config(eos=2), 5, streamer=None)
    tokens = torch.tensor([[3, 2, 4], [3, 4, 4], [3, 7, 3], [3, 3, 3], [3, 3, 3]])
    finished = commit(batch, tokens, torch.tensor([3, 3, 3, 3, 3]))
    assert finished.tolist() == [True, False, True, True, True]
    assert batch.num_generated.tolist() == [2, 3, 2, 5, 0]
    assert batch.sequences()[:3, 2:5].tolist() == [[3, 2, PAD], [3, 4, 4], [3, 7, PAD]]


def test_committer_keeps_counts_shorter_than_the_tokens_given():
    batch = started_batch(torch.full((2, 2), 5), None, 8, PAD)
    commit = Committer(None, _generation_config(eos=2), 10, streamer=None)
    finished = commit(batch, torch.tensor([[3, 2, 4], [3, 4, 2]]), torch.tensor([1, 2]))  # EOS past the counts
    assert finished.tolist() == [False, False] and batch.num_generated.tolist() == [1, 2]


def _ragged_batch_with_drafts() -> RaggedBatch:
    """Three rows that generated 0, 2 and 1 tokens, with drafts written after each prefix."""
    generator = torch.Generator().manual_seed(0)
    batch = started_batch(torch.randint(3, 12, (3, 4), generator=generator), None, 8, PAD)
    batch.commit_tokens(torch.randint(3, 12, (3, 2), generator=generator), torch.tensor([0, 2, 1]))
    batch.write(torch.randint(3, 12, (3, 3), generator=generator))
    return batch


def test_processing_reads_each_positions_own_prefix():
    """A processor that reads the prefix sees, at position j of row b, exactly row b's committed tokens plus its
    drafts before j (what plain `generate` would pass it there)."""
    batch = _ragged_batch_with_drafts()
    processors = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(1.7), MinNewTokensLengthLogitsProcessor(6, 2, eos_token_id=2),
        TemperatureLogitsWarper(0.7),
    ])
    logits = torch.randn(3, 3, 12, generator=torch.Generator().manual_seed(1))
    processed = RaggedLogitsProcessor(processors)(batch, logits)
    prefix = batch.prefix_lengths()
    for b in range(3):
        for j in range(3):
            expected = processors(batch.tokens[b : b + 1, : int(prefix[b]) + j], logits[b, j][None].clone())
            torch.testing.assert_close(processed[b, j], expected[0])
    assert not torch.equal(processed[0, 0], processed[0, 1])  # different prefixes, different penalties


def test_prefix_free_processing_runs_once_over_all_positions():
    batch = _ragged_batch_with_drafts()
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.5), TopKLogitsWarper(3)])
    processor = RaggedLogitsProcessor(processors)
    logits = torch.randn(3, 3, 12, generator=torch.Generator().manual_seed(2))
    assert not processor.reads_prefix
    expected = processors(batch.tokens[:1, :1].expand(9, 1), logits.reshape(9, 12).clone()).view(3, 3, 12)
    torch.testing.assert_close(processor(batch, logits), expected)
