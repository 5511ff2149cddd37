"""The engine's grouped-query attention gives the target's own outputs, and only while the engine runs."""

from __future__ import annotations

import pytest
import torch
from conftest import make_target
from helpers import make_batch

from hf_specformer.generation.attention import (
    GQA_SDPA,
    PACKED_QUERY_LIMIT,
    GroupedQueryAttention,
    _packed_query_attention,
)
from hf_specformer.generation.forwards import cache_argument


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("num_queries", [2, PACKED_QUERY_LIMIT, PACKED_QUERY_LIMIT + 1])
def test_masked_multi_query_forward_is_unchanged(kind, num_queries, monkeypatch):
    """Padded rows, a cache, several new queries per row: the target's own logits, with SDPA run on grouped heads
    (packed queries up to `PACKED_QUERY_LIMIT` per row, `enable_gqa` beyond, bit for bit there) and never on
    repeated key/value heads."""
    target = make_target(kind)
    input_ids, mask = make_batch(4, seed=1, min_len=num_queries + 2, max_len=num_queries + 8)
    with torch.no_grad():
        prefix = target(input_ids[:, :-num_queries], attention_mask=mask[:, :-num_queries],
                        use_cache=True).past_key_values
        reference = target(input_ids[:, -num_queries:], attention_mask=mask, **cache_argument(target, prefix)).logits
        prefix.crop(-num_queries)
        key_heads = []
        sdpa = torch.nn.functional.scaled_dot_product_attention
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            lambda q, k, v, **kw: key_heads.append((q.shape[1:3], k.shape[1], kw.get("enable_gqa")))
                            or sdpa(q, k, v, **kw))
        with GroupedQueryAttention(target):
            assert target.config._attn_implementation == GQA_SDPA
            logits = target(input_ids[:, -num_queries:], attention_mask=mask, **cache_argument(target, prefix)).logits
    assert target.config._attn_implementation == "sdpa"
    config = target.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if num_queries <= PACKED_QUERY_LIMIT:
        expected = ((kv_heads, heads // kv_heads * num_queries), kv_heads, None)
        tolerance = dict(rtol=1e-13, atol=1e-13)
    else:
        expected = ((heads, num_queries), kv_heads, True)
        tolerance = dict(rtol=0, atol=0)
    assert key_heads == [expected] * config.num_hidden_layers
    torch.testing.assert_close(logits, reference, **tolerance)


def test_packed_queries_attend_like_grouped_heads():
    """The packing alone, float32, against `enable_gqa` on a mask with holes: query head h reads key/value head
    h // groups under its own row of the mask."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, 6, 8, generator=generator).transpose(1, 2)  # [B, H, T, D], as the layers make it
    key, value = torch.randn(2, 3, 2, 11, 8, generator=generator)
    mask = torch.rand(3, 1, 4, 11, generator=generator) > 0.3
    mask[..., 0] = True
    packed = _packed_query_attention(query, key, value, mask, groups=3, dropout=0.0, scaling=None)
    grouped = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(packed, grouped, rtol=1e-6, atol=1e-6)


def test_other_attention_implementations_are_left_alone():
    target = make_target("llama")
    target.set_attn_implementation("eager")
    with GroupedQueryAttention(target):
        assert target.config._attn_implementation == "eager"
    assert target.config._attn_implementation == "eager"
