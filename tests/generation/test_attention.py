"""The engine's grouped-query attention gives the target's own outputs, and only while the engine runs."""

from __future__ import annotations

import pytest
import torch
from conftest import make_target
from helpers import make_batch

from hf_specformer.generation.attention import GQA_SDPA, GroupedQueryAttention
from hf_specformer.generation.forwards import cache_argument


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_masked_multi_query_forward_is_unchanged(kind, monkeypatch):
    """Padded rows, a cache, several new queries per row: the same logits, and SDPA really ran with grouped heads."""
    target = make_target(kind)
    input_ids, mask = make_batch(4, seed=1)
    with torch.no_grad():
        prefix = target(input_ids[:, :-3], attention_mask=mask[:, :-3], use_cache=True).past_key_values
        reference = target(input_ids[:, -3:], attention_mask=mask, **cache_argument(target, prefix)).logits
        prefix.crop(-3)
        calls = []
        sdpa = torch.nn.functional.scaled_dot_product_attention
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            lambda *a, **kw: calls.append(kw.get("enable_gqa")) or sdpa(*a, **kw))
        with GroupedQueryAttention(target):
            assert target.config._attn_implementation == GQA_SDPA
            logits = target(input_ids[:, -3:], attention_mask=mask, **cache_argument(target, prefix)).logits
    assert target.config._attn_implementation == "sdpa"
    assert calls == [True] * target.config.num_hidden_layers
    torch.testing.assert_close(logits, reference, rtol=0, atol=0)


def test_other_attention_implementations_are_left_alone():
    target = make_target("llama")
    target.set_attn_implementation("eager")
    with GroupedQueryAttention(target):
        assert target.config._attn_implementation == "eager"
    assert target.config._attn_implementation == "eager"
