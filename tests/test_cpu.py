"""The CPU backend (`cpu_products`): its products compute the layers' own functions, packed inputs equal the full
forward where they are kept, its attention is `GQA_SDPA` for the block, plain and speculative `generate` under it equal
plain `generate`, and every model is its own again after the block, also on errors."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_ONLY, TINY_VOCAB, make_drafter, make_target
from generation.helpers import PAD, assert_same_as_generate, make_batch
from torch import nn

from hf_specformer import cpu_products
import hf_specformer.cpu as cpu
from hf_specformer.attention import GQA_SDPA
from hf_specformer.cpu import FEW_HEAD_ROWS, FEW_ROWS, padded_rows, transposed_linear

pytestmark = CPU_ONLY
DOUBLE = {"dtype": torch.float64}


class SubclassedLinear(nn.Linear):
    """Stands for PEFT or quantised layers: a subclass may compute something else, so it keeps its own products."""

    def forward(self, x):
        return super().forward(x) + 1


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


def test_few_row_products_serve_eligible_layers_only_and_only_inside_the_block(monkeypatch):
    """Plain float `nn.Linear` layers up to their row bound (the head's larger); a bfloat16 layer and a subclass keep
    their own forward; after the block every layer is its own and the state dict never changed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, **DOUBLE), nn.Linear(8, 8, dtype=torch.bfloat16),
                          SubclassedLinear(8, 8, **DOUBLE), nn.Linear(8, 9, **DOUBLE))
    model.get_output_embeddings = lambda: model[3]
    model.config = None
    calls = []
    monkeypatch.setattr("hf_specformer.cpu.transposed_is_faster", lambda weight, rows: True)
    monkeypatch.setattr("hf_specformer.cpu.transposed_linear",
                        lambda x, w, b=None: calls.append(x.reshape(-1, x.shape[-1]).shape[0]) or
                        transposed_linear(x, w, b))
    keys = list(model.state_dict())
    with cpu_products(model):
        assert list(model.state_dict()) == keys
        model[0](torch.randn(FEW_ROWS, 6, **DOUBLE))
        model[0](torch.randn(FEW_ROWS + 1, 6, **DOUBLE))
        model[3](torch.randn(FEW_HEAD_ROWS, 8, **DOUBLE))
        model[1](torch.randn(3, 8, dtype=torch.bfloat16))
        x = torch.randn(3, 8, **DOUBLE)
        assert torch.equal(model[2](x), nn.functional.linear(x, model[2].weight, model[2].bias) + 1)
    assert calls == [FEW_ROWS, FEW_HEAD_ROWS]
    assert not any("forward" in layer.__dict__ for layer in model)


def test_a_shape_runs_transposed_only_where_that_was_timed_faster(monkeypatch):
    """Each (shape, rows, dtype) is timed once: W @ x^T where it is clearly faster, else the layer's own product."""
    monkeypatch.setattr(cpu, "_TRANSPOSED_FASTER", {})
    slow = {"transposed": True}

    def timed_call(call, repeats=5):
        call()
        return 2.0 if (call.func is transposed_linear) == slow["transposed"] else 1.0
    monkeypatch.setattr(cpu, "_best_seconds", timed_call)
    weight = torch.randn(8, 6, **DOUBLE)
    assert not cpu.transposed_is_faster(weight, 2)
    slow["transposed"] = False
    assert not cpu.transposed_is_faster(weight, 2)  # timed once per shape and process
    assert cpu.transposed_is_faster(weight, 4) and cpu.transposed_is_faster(weight.float(), 2)
    layer, calls = nn.Linear(6, 8, **DOUBLE), []
    layer.config = None
    monkeypatch.setattr(cpu, "transposed_linear",
                        lambda x, w, b=None: calls.append(len(x)) or transposed_linear(x, w, b))
    with cpu_products(layer):
        x = torch.randn(4, 6, **DOUBLE)
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
        layer(torch.randn(2, 6, **DOUBLE))
    assert calls == [4]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_inputs_masked_out_are_skipped_and_the_kept_ones_equal_the_full_forward(kind):
    """A step whose last inputs are masked out (drafts it does not verify) and a left-padded prefill: the kept
    inputs' logits and hidden states are the full forward's; the head's output at skipped inputs is zero."""
    target = make_target(kind)
    ids = torch.randint(3, TINY_VOCAB, (4, 6), generator=torch.Generator().manual_seed(0))
    for kept in (torch.arange(6)[None, :] < torch.tensor([6, 1, 3, 2])[:, None],  # prefixes: a step
                 torch.arange(6)[None, :] >= 6 - torch.tensor([6, 2, 4, 1])[:, None]):  # suffixes: a prefill
        mask = kept.long() if kept[:, -1].all() else torch.ones_like(ids)
        with torch.no_grad():
            full = target(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            if not kept[:, -1].all():  # a step: the new inputs' columns say which are kept
                mask = kept.long()
                full = target(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
            with cpu_products(target):
                output = target(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        torch.testing.assert_close(output.logits[kept], full.logits[kept], rtol=1e-10, atol=1e-10)
        for ours, theirs in zip(output.hidden_states[1:], full.hidden_states[1:]):
            torch.testing.assert_close(ours[kept], theirs[kept], rtol=1e-10, atol=1e-10)
        assert (output.logits[~kept] == 0).all()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_plain_and_speculative_generate_under_the_backend_equal_plain_generate(kind):
    target = make_target(kind)
    target.set_attn_implementation("sdpa")
    drafter = make_drafter(target)
    input_ids, mask = make_batch(6, seed=5)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    with cpu_products(target, drafter):
        assert torch.equal(target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                           max_new_tokens=16), reference)
        stats = assert_same_as_generate(target, drafter, input_ids, mask, max_new_tokens=16, pad_token_id=PAD,
                                        schedule="fixed").speculation_stats
    assert stats.drafted > 0


def test_every_model_is_its_own_again_after_the_block_also_on_errors():
    target = make_target("llama")
    target.set_attn_implementation("sdpa")
    drafter = make_drafter(target)
    hooked = target.model.layers[0].mlp.up_proj
    hooked.forward = lambda x, inner=hooked.forward: inner(x) * 2  # a layer with a forward of its own (a hook)
    with pytest.raises(RuntimeError, match="boom"), cpu_products(target, drafter):
        assert target.config._attn_implementation == GQA_SDPA and target._forward_pre_hooks
        raise RuntimeError("boom")
    assert target.config._attn_implementation == "sdpa" and not target._forward_pre_hooks
    assert hooked.__dict__["forward"].__name__ == "<lambda>"
    linears = [m for model in (target, drafter) for m in model.modules() if isinstance(m, nn.Linear)]
    assert sum("forward" in linear.__dict__ for linear in linears) == 1
