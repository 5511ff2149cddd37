"""The preallocated KV cache: the same forwards as a `DynamicCache` through steps, row selection and compaction;
rows appended; the bytes a slot takes."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_ONLY, TINY_VOCAB, make_drafter, make_target
from helpers import PAD, assert_same_as_generate, make_batch
from transformers.cache_utils import DynamicCache

from hf_specformer import SpecFormerProposer
from hf_specformer.generation.cache import PreallocatedCache, PreallocatedLayer, cache_capacity, kv_bytes_per_column
from hf_specformer.generation.engine import VOCABULARY_COPIES, slot_bytes


def _forward(target, ids, mask, cache, positions):
    return target(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                  cache=cache)


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


def test_rows_appended_to_a_cache_keep_their_columns_and_pad_with_zeros():
    """A cache of 3 rows (its buffers' rows) keeps 2 of 5 columns, then + [1 row, 3 columns] -> 3 rows of 5, the
    new row's last 2 zero; keeps 2 again, then + [1 row, 7 columns] -> 3 rows of 7, the older rows' last 2 zero."""
    cache, part, longer = (PreallocatedCache(num_layers=1, capacity=8) for _ in range(3))
    start = torch.randn(3, 1, 5, 4)
    cache.update(start, start, 0)
    cache.batch_select_indices(torch.tensor([0, 2]))
    first = torch.randn(1, 1, 3, 4)
    part.update(first, first, 0)
    cache.append_rows(part, 3)
    keys = cache.layers[0].keys
    assert keys.shape == (3, 1, 5, 4) and torch.equal(keys[:2], start[[0, 2]])
    assert torch.equal(keys[2, :, :3], first[0]) and not keys[2, :, 3:].any()
    second = torch.randn(1, 1, 7, 4)
    longer.update(second, second, 0)
    with pytest.raises(RuntimeError, match="rows"):  # the buffers hold the slots
        cache.append_rows(longer, 3)
    cache.batch_select_indices(torch.tensor([0, 2]))
    cache.append_rows(longer, 3)
    keys = cache.layers[0].keys
    assert keys.shape == (3, 1, 7, 4) and torch.equal(keys[2], second[0]) and not keys[:2, :, 5:].any()
    assert torch.equal(keys[0, :, :5], start[0]) and torch.equal(keys[1, :, :3], first[0])


@pytest.mark.parametrize("max_batch_size", [2, None])
def test_no_column_is_read_before_it_is_written(max_batch_size, monkeypatch):
    """Buffers filled with NaN where they are allocated (uninitialised memory may hold NaN): a speculative call whose
    rows join running ones with longer prompts (2 slots, shortest prompts first, the first row ending early) or
    shorter ones (prefill groups) still equals plain `generate`: attention never reads a column (masked or not)
    that no forward or padding wrote."""
    allocate = PreallocatedLayer.lazy_initialization

    def poisoned(layer, *args, **kwargs):
        allocate(layer, *args, **kwargs)
        layer.key_buffer.fill_(float("nan"))
        layer.value_buffer.fill_(float("nan"))

    monkeypatch.setattr(PreallocatedLayer, "lazy_initialization", poisoned)
    target = make_target("llama")
    input_ids, mask = make_batch(7, seed=5, min_len=2, max_len=40)
    order = mask.sum(1).argsort()
    input_ids, mask = input_ids[order], mask[order]
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    assert_same_as_generate(target, make_drafter(target), input_ids, mask, schedule="fixed", max_new_tokens=8,
                            pad_token_id=PAD, eos_token_id=int(reference[0, input_ids.shape[1] + 1]),
                            max_batch_size=max_batch_size)


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
    output = target(input_ids=input_ids, attention_mask=mask, output_hidden_states=True,
                    cache=cache)
    drafter_cache = PreallocatedCache(proposer.num_cache_layers, capacity)
    hooked = torch.stack([output.hidden_states[i] for i in proposer.drafter.config.hook_layers], dim=2)
    proposer.drafter(hooked, past_key_values=drafter_cache, return_logits=False)
    target_per_column = kv_bytes_per_column(config, config.num_hidden_layers, target.dtype)
    assert _buffer_bytes(cache) == 3 * capacity * target_per_column
    assert _buffer_bytes(drafter_cache) == 3 * capacity * proposer.cache_bytes_per_column > 0
    recorded = set(proposer.drafter.config.hook_layers) | {config.num_hidden_layers}  # the drafter's and the last
    rest = VOCABULARY_COPIES * 4 * config.vocab_size * 8 + len(recorded) * width * config.hidden_size * 8
    assert slot_bytes(target, proposer, width, max_new_tokens) == \
        capacity * (target_per_column + proposer.cache_bytes_per_column) + rest


