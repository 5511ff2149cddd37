"""Packed verification: a forward whose linear layers compute only the selected inputs of each row."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import TINY_VOCAB, make_target

from hf_specformer.generation.packing import PackedLinears
from hf_specformer.generation.products import FewRowLinears


def _forward(target, ids):
    with torch.no_grad():
        return target(input_ids=ids, output_hidden_states=True)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("few_rows", [False, True])
def test_selected_inputs_equal_the_full_forward_and_the_rest_are_zero_logits(kind, few_rows):
    """Each row's selected prefix gives the logits and hidden states of the unpacked forward (the causal mask keeps
    the unselected inputs out of them); the head's output at unselected inputs is zero."""
    target = make_target(kind)
    ids = torch.randint(3, TINY_VOCAB, (4, 5), generator=torch.Generator().manual_seed(0))
    selected = torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 2])[:, None]
    full = _forward(target, ids)
    packed = PackedLinears(target)
    with FewRowLinears([target]) if few_rows else contextlib.nullcontext():
        with packed.select(selected):
            output = _forward(target, ids)
    torch.testing.assert_close(output.logits[selected], full.logits[selected], rtol=1e-10, atol=1e-10)
    for ours, theirs in zip(output.hidden_states, full.hidden_states):
        torch.testing.assert_close(ours[selected], theirs[selected], rtol=1e-10, atol=1e-10)
    assert (output.logits[~selected] == 0).all()


def test_layers_are_restored_after_the_block_also_on_errors_and_inside_few_row_linears():
    target = make_target("llama")
    packed = PackedLinears(target)
    selected = torch.tensor([[True, False]])
    with FewRowLinears([target]):
        few_row = {id(linear): linear.forward for linear in packed.linears}
        with pytest.raises(RuntimeError, match="boom"), packed.select(selected):
            assert all(linear.forward is not few_row[id(linear)] for linear in packed.linears)
            raise RuntimeError("boom")
        assert all(linear.forward is few_row[id(linear)] for linear in packed.linears)
    assert all("forward" not in linear.__dict__ for linear in packed.linears)


def test_a_full_selection_or_packing_off_leaves_the_layers_alone():
    target = make_target("llama")
    packed = PackedLinears(target)
    for selected, on in ((torch.ones(2, 3, dtype=torch.bool), True), (torch.tensor([[True, False]]), False)):
        with packed.select(selected, packed=on):
            assert all("forward" not in linear.__dict__ for linear in packed.linears)
