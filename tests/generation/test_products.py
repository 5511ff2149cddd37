"""The few-row CPU products compute exactly the linear layers' functions, and only inside their context."""

from __future__ import annotations

import torch
from conftest import make_drafter, make_target
from torch import nn

from hf_specformer import SpecFormerProposer
from hf_specformer.generation.products import FEW_HEAD_ROWS, FEW_ROWS, FewRowLinears, transposed_linear


class SubclassedLinear(nn.Linear):
    """Stands for PEFT or quantised layers: a subclass may compute something else, so it keeps its forward."""


def test_transposed_linear_is_f_linear():
    torch.manual_seed(0)
    weight, bias = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    for shape in [(5,), (1, 5), (3, 5), (2, 4, 5)]:
        x = torch.randn(*shape, dtype=torch.float64)
        for b in (None, bias):
            out = transposed_linear(x, weight, b)
            assert out.shape == (*shape[:-1], 7) and out.is_contiguous()
            torch.testing.assert_close(out, nn.functional.linear(x, weight, b), rtol=0, atol=1e-12)


def test_few_row_linears_switch_eligible_layers_inside_the_context_only():
    torch.manual_seed(0)
    double = dict(dtype=torch.float64)
    layers = [nn.Linear(6, 8, **double), nn.Linear(8, 8, dtype=torch.bfloat16), SubclassedLinear(8, 8, **double)]
    model = nn.Sequential(*layers, nn.Linear(8, 9, **double))
    head = model[3]
    with FewRowLinears([model], head=head) as switched:
        assert set(map(id, switched.linears.values())) == {id(model[0]), id(head)}
        assert "forward" in model[0].__dict__ and "forward" not in model[2].__dict__
        few, many = torch.randn(FEW_ROWS, 6, dtype=torch.float64), torch.randn(FEW_ROWS + 1, 6, dtype=torch.float64)
        assert torch.equal(model[0](few), transposed_linear(few, model[0].weight, model[0].bias))
        assert torch.equal(model[0](many), nn.functional.linear(many, model[0].weight, model[0].bias))
        hidden = torch.randn(FEW_HEAD_ROWS, 8, dtype=torch.float64)
        assert torch.equal(head(hidden), transposed_linear(hidden, head.weight, head.bias))
        with FewRowLinears([model]) as inner:  # nested: the inner context leaves switched layers alone
            assert not inner.linears
        assert "forward" in model[0].__dict__
    assert not any("forward" in layer.__dict__ for layer in model)


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
