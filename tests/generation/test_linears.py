"""The loop's switched linear layers: few-row products compute exactly the layers' functions, packed forwards equal
the full forward at the selected inputs, and every layer is its own again after the call, also on errors."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, make_drafter, make_target
from torch import nn

from hf_specformer import SpecFormerProposer
from hf_specformer.generation.forwards import LoopLayers
from hf_specformer.generation.linears import (
    FEW_HEAD_ROWS,
    FEW_ROWS,
    LinearSwitch,
    padded_rows,
    transposed_linear,
)

DOUBLE = {"dtype": torch.float64}


class SubclassedLinear(nn.Linear):
    """Stands for PEFT or quantised layers: a subclass may compute something else, so it keeps its own products."""

    def forward(self, x):
        return super().forward(x) + 1


def _forward(target, ids):
    with torch.no_grad():
        return target(input_ids=ids, output_hidden_states=True)


def test_transposed_linear_is_f_linear():
    torch.manual_seed(0)
    weight, bias = torch.randn(7, 5, **DOUBLE), torch.randn(7, **DOUBLE)
    for shape in [(5,), (1, 5), (3, 5), (2, 4, 5), (7, 5), (3, 3, 5), (17, 5)]:  # padded to 2, 4, 8, 16, 24 rows
        x = torch.randn(*shape, **DOUBLE)
        for b in (None, bias):
            out = transposed_linear(x, weight, b)
            assert out.shape == (*shape[:-1], 7) and out.is_contiguous()
            torch.testing.assert_close(out, nn.functional.linear(x, weight, b), rtol=0, atol=1e-12)


def test_padded_rows_are_at_least_the_rows_and_beyond_8_a_multiple_of_8():
    padded = [padded_rows(rows) for rows in range(1, 42)]
    assert padded[:9] == [2, 2, 4, 4, 5, 6, 8, 8, 16]
    assert all(rows <= count < rows + 8 for rows, count in enumerate(padded, start=1))
    assert all(count % 8 == 0 for count in padded[8:]) and padded_rows(32) == 32


def test_few_rows_switch_eligible_layers_only_and_only_inside_the_block():
    """Few-row products serve plain float `nn.Linear` layers up to their row bound (the head's larger); a bfloat16
    layer and a subclass compute with their own forward; switched off, or after the call, every layer is its own."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8, **DOUBLE), nn.Linear(8, 8, dtype=torch.bfloat16), SubclassedLinear(8, 8, **DOUBLE)]
    model = nn.Sequential(*layers, nn.Linear(8, 9, **DOUBLE))
    head = model[3]
    switch = LinearSwitch([model], head=head)
    few, many = torch.randn(FEW_ROWS, 6, **DOUBLE), torch.randn(FEW_ROWS + 1, 6, **DOUBLE)
    hidden = torch.randn(FEW_HEAD_ROWS, 8, **DOUBLE)
    products = []
    with switch.installed():
        assert list(model.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias",
                                            "3.weight", "3.bias"]
        assert torch.equal(model[0](few), nn.functional.linear(few, model[0].weight, model[0].bias))  # off
        with switch.few_rows():
            products.append(model[0](few))
            assert torch.equal(model[0](many), nn.functional.linear(many, model[0].weight, model[0].bias))
            assert torch.equal(head(hidden), transposed_linear(hidden, head.weight, head.bias))
            x = torch.randn(3, 8, **DOUBLE)
            assert torch.equal(model[2](x), nn.functional.linear(x, model[2].weight, model[2].bias) + 1)
    assert torch.equal(products[0], transposed_linear(few, model[0].weight, model[0].bias))
    assert not any("forward" in layer.__dict__ for layer in model)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("cpu_speedups", [False, True])
def test_selected_inputs_equal_the_full_forward_and_the_rest_are_zero_logits(kind, cpu_speedups):
    """Each row's selected prefix gives the logits and hidden states of the unpacked forward (the causal mask keeps
    the unselected inputs out of them); the head's output at unselected inputs is zero."""
    target = make_target(kind)
    ids = torch.randint(3, TINY_VOCAB, (4, 5), generator=torch.Generator().manual_seed(0))
    selected = torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 2])[:, None]
    full = _forward(target, ids)
    layers = LoopLayers(target, [target], cpu_speedups)
    with layers.installed(), layers.speedups(), layers.packed(selected):
        output = _forward(target, ids)
    torch.testing.assert_close(output.logits[selected], full.logits[selected], rtol=1e-10, atol=1e-10)
    for ours, theirs in zip(output.hidden_states, full.hidden_states):
        torch.testing.assert_close(ours[selected], theirs[selected], rtol=1e-10, atol=1e-10)
    assert (output.logits[~selected] == 0).all()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_left_padded_prefill_packed_to_its_real_tokens_equals_the_full_forward_there(kind):
    """A prefill's selection is each row's real prompt tokens, a suffix under left padding: the attention mask keeps
    the padding out of every real token's logits and hidden states."""
    target = make_target(kind)
    ids = torch.randint(3, TINY_VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))
    selected = torch.arange(6)[None, :] >= 6 - torch.tensor([6, 2, 4])[:, None]
    mask = selected.long()
    with torch.no_grad():
        full = target(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        layers = LoopLayers(target, [target])
        with layers.installed(), layers.speedups(), layers.packed(selected):
            output = target(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    torch.testing.assert_close(output.logits[selected], full.logits[selected], rtol=1e-10, atol=1e-10)
    for ours, theirs in zip(output.hidden_states, full.hidden_states):
        torch.testing.assert_close(ours[selected], theirs[selected], rtol=1e-10, atol=1e-10)


def test_layers_and_attention_are_restored_after_the_call_also_on_errors():
    target = make_target("llama")
    hooked = target.model.layers[0].mlp.up_proj
    hooked.forward = lambda x, inner=hooked.forward: inner(x) * 2  # a layer with a forward of its own (a hook)
    layers = LoopLayers(target, [target])
    selected = torch.tensor([[True, False]])
    with pytest.raises(RuntimeError, match="boom"), layers.installed(), layers.speedups(), layers.packed(selected):
        assert target.config._attn_implementation != "sdpa"
        assert layers.linears.packing is not None and layers.linears.few_rows_on
        raise RuntimeError("boom")
    assert target.config._attn_implementation == "sdpa"
    assert layers.linears.packing is None and not layers.linears.few_rows_on
    assert hooked.__dict__["forward"].__name__ == "<lambda>"
    assert sum("forward" in linear.__dict__ for linear in target.modules() if isinstance(linear, nn.Linear)) == 1


def test_a_full_selection_or_packing_off_packs_nothing():
    target = make_target("llama")
    switch = LinearSwitch([target])
    for selected, on in ((torch.ones(2, 3, dtype=torch.bool), True), (torch.tensor([[True, False]]), False)):
        with switch.installed(), switch.packed(selected, enabled=on):
            assert switch.packing is None


def test_the_proposer_exposes_the_drafters_draft_head():
    target = make_target("llama")
    drafter = make_drafter(target)
    drafter.set_draft_vocab(list(range(0, target.config.vocab_size, 2)))
    modules = SpecFormerProposer(drafter).modules()
    draft_head = drafter.draft_head()
    assert modules == [drafter, draft_head] and isinstance(draft_head, nn.Linear)
    ids = drafter.draft_vocab_ids
    assert torch.equal(draft_head.weight, target.get_output_embeddings().weight[ids])
    assert draft_head not in list(drafter.modules()) and not any("draft_head" in k for k in drafter.state_dict())
