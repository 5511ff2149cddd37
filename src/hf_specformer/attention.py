"""Grouped-query attention that reads each key/value head once, for targets loaded with `attn_implementation=GQA_SDPA`.

For several queries per row under a mask (a verification step), `transformers`' `sdpa` copies every layer's whole
cache H / H_kv times (`repeat_kv`). Here the CPU's kernel takes the mask and the grouped heads directly
(`enable_gqa`); on other devices, where a masked `enable_gqa` falls back to the math kernel, up to
`PACKED_QUERY_LIMIT` queries per row (a verification step) each key/value head's queries are packed into one sequence
(`[B, H, T, D]` -> `[B, H_kv, (H / H_kv) T, D]`, the mask repeated to match), as `transformers` does for one query,
and longer blocks (a padded prefill) run `transformers`' own function. Outputs equal `sdpa`'s up to summation order.

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
"""Up to this many queries per row, each key/value head's queries are packed into one sequence (off the CPU)."""


def gqa_sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                               **kwargs):
    """`sdpa_attention_forward` without copies of the key/value heads under a mask: query `[B, H, T, D]`, key and
    value `[B, H_kv, S, D]`, mask `[B, 1, T, S]` -> `[B, T, H, D]`."""
    groups = getattr(module, "num_key_value_groups", 1)
    delegated = kwargs.get("softcap") or kwargs.get("position_bias") is not None or kwargs.get("output_attentions")
    length = query.shape[2]
    masked_multi_query = groups > 1 and attention_mask is not None and length > 1 and not delegated
    if masked_multi_query and query.device.type == "cpu":
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    elif masked_multi_query and length <= PACKED_QUERY_LIMIT and attention_mask.shape[1] == 1:
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


AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention_forward)
AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
