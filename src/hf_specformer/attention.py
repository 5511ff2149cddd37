"""Grouped-query attention that reads each key/value head once, for targets loaded with `attn_implementation=GQA_SDPA`.

For several queries per row under a mask, `transformers`' `sdpa` copies every layer's cache H / H_kv times. Here, on
the CPU, the kernel takes the grouped heads (`enable_gqa`), or from `MATMUL_MIN_ROWS` rows two batched products do;
elsewhere each key/value head's queries are packed into one sequence (up to `PACKED_QUERY_LIMIT` queries per row).
Outputs equal `sdpa`'s up to summation order.

    target = AutoModelForCausalLM.from_pretrained(name, attn_implementation=hf_specformer.GQA_SDPA)
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GQA_SDPA = "hf_specformer_gqa_sdpa"
"""The name the attention function is registered under with `transformers`' attention and mask interfaces."""

PACKED_QUERY_LIMIT = 8
"""Up to this many queries per row, each key/value head's queries are packed into one sequence."""

MATMUL_MIN_ROWS = 8
"""From this many rows, packed queries attend through two batched products on the CPU (float32 or float64 under a
float mask): below it the flash kernel is as fast or faster (docs/log.md, attention on the CPU)."""


def gqa_sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                               **kwargs):
    """`sdpa_attention_forward` without copies of the key/value heads under a mask: query `[B, H, T, D]`, key and
    value `[B, H_kv, S, D]`, mask `[B, 1, T, S]` -> `[B, T, H, D]`."""
    groups = getattr(module, "num_key_value_groups", 1)
    delegated = kwargs.get("softcap") or kwargs.get("position_bias") is not None or kwargs.get("output_attentions")
    length = query.shape[2]
    masked_multi_query = groups > 1 and attention_mask is not None and length > 1 and not delegated
    packable = masked_multi_query and length <= PACKED_QUERY_LIMIT and attention_mask.shape[1] == 1
    on_cpu = query.device.type == "cpu"
    if packable and on_cpu and _products_serve(query, attention_mask, dropout):
        output = grouped_matmul_attention(query, key, value, attention_mask, scaling)
    elif masked_multi_query and on_cpu:
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    elif packable:
        output = packed_query_attention(query, key, value, attention_mask, dropout, scaling)
    else:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    return output.transpose(1, 2).contiguous(), None


def packed_query_attention(query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None):
    """Query `[B, H, T, D]`, key and value `[B, H_kv, S, D]`, mask `[B, 1, T, S]` -> `[B, H, T, D]`, with each key/value
    head's queries packed into one sequence: query head h = g * H / H_kv + r at packed position r * T + t."""
    batch, heads, length, head_dim = query.shape
    groups = heads // key.shape[1]
    output = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, key.shape[1], groups * length, head_dim), key, value,
        attn_mask=attention_mask.repeat(1, 1, groups, 1), dropout_p=dropout, scale=scaling)
    return output.view(batch, heads, length, head_dim)


def _products_serve(query, attention_mask, dropout: float) -> bool:
    """Whether `grouped_matmul_attention` serves packed queries on the CPU (see `MATMUL_MIN_ROWS`)."""
    floats = (torch.float32, torch.float64)
    return not dropout and query.shape[0] >= MATMUL_MIN_ROWS and query.dtype in floats and \
        attention_mask.dtype == query.dtype


def grouped_matmul_attention(query, key, value, attention_mask, scaling: float | None = None):
    """`packed_query_attention` as two batched products and a softmax between them, under an additive float mask
    `[B, 1, T, S]` (added, with the scale, inside the first product): query `[B, H, T, D]`, key and value
    `[B, H_kv, S, D]` -> `[B, H, T, D]`."""
    batch, heads, length, head_dim = query.shape
    kv_heads, columns = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scores = query.new_empty(batch * kv_heads, groups * length, columns)  # the mask, then the product added into it
    scores.view(batch, kv_heads, groups, length, columns).copy_(attention_mask[:, :, None])
    packed = query.reshape(batch * kv_heads, groups * length, head_dim)
    keys = key.reshape(batch * kv_heads, columns, head_dim).transpose(1, 2)
    scores.baddbmm_(packed, keys, alpha=head_dim**-0.5 if scaling is None else scaling)
    weights = scores.softmax(-1)
    return torch.bmm(weights, value.reshape(batch * kv_heads, columns, head_dim)).view(batch, heads, length, head_dim)


AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention_forward)
AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
