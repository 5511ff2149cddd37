"""Grouped-query attention without copying the KV cache, for the verification forwards on the CPU.

A verification step feeds k + 1 queries per row with an attention mask (the ragged batch's holes). For several
queries and a mask, `transformers`' SDPA integration repeats the key/value heads of grouped-query models
(`repeat_kv`): every layer copies its whole cache, num_attention_heads / num_key_value_heads times, on every step.
On the CPU, torch's SDPA takes the mask and the grouped heads directly (`enable_gqa=True`) with the same result,
bit for bit, and several times faster over long caches (README, How it works).

For a few queries per row (`PACKED_QUERY_LIMIT`: a verification step's w + 1) the kernel still reads each key/value
head once per query head that shares it. There the queries of each key/value head are packed into one sequence
instead, `[B, H, T, D]` -> `[B, H_kv, (H / H_kv) T, D]` with the mask repeated to match, which is what `transformers`
does for a single query (`pack_gqa`): every key and value column is then read once per key/value head. On the CPU
testbed (SmolLM2's 9 query and 3 key/value heads, 300 cached columns, one layer) that is 849 -> 521 us at B = 8 and
T = 2, 863 -> 592 us at T = 4, 2161 -> 1654 us at B = 16 and T = 4, 1354 -> 1117 us at B = 8 and T = 8, and no
faster from T = 16 on (prefills keep `enable_gqa`). Each query still attends to the same columns under the same
mask; only the product kernel's blocking changes, so outputs equal `enable_gqa`'s up to summation order (equal in
most cases measured, else within 1 ulp), like the loop's few-row products (`linears.py`).

`GroupedQueryAttention` switches a model that uses `sdpa` to this function for the length of a speculative call and
restores it after. transformers picks a layer's attention function from the shared `config._attn_implementation` on
every forward and offers no per-call choice, so the switch is that attribute, set once per call; since the function
equals SDPA's (up to summation order for packed queries), another thread running the same model meanwhile gets
the same results. On other devices (where masked GQA would leave SDPA's fast kernels), for a single query (which
`transformers` already handles without copies) and without a mask it calls `transformers`' own SDPA function.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GQA_SDPA = "hf_specformer_gqa_sdpa"
"""The name under which the function is registered with `transformers`' attention and mask interfaces."""

DELEGATED_KWARGS = ("softcap", "position_bias", "cache", "output_attentions")
"""Arguments that only `transformers`' own SDPA function handles (or rejects): when given, it runs instead."""

PACKED_QUERY_LIMIT = 8
"""Up to this many queries per row, each key/value head's queries are packed into one sequence (module docstring)."""


def gqa_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`sdpa_attention_forward` with masked grouped-query attention on the CPU: query `[B, H, T, D]`, key and value
    `[B, H_kv, S, D]`, mask `[B, 1, T, S]` -> output `[B, T, H, D]`."""
    groups = getattr(module, "num_key_value_groups", 1)
    delegated = any(kwargs.get(name) for name in DELEGATED_KWARGS)
    if groups == 1 or attention_mask is None or query.shape[2] == 1 or query.device.type != "cpu" or delegated:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if query.shape[2] <= PACKED_QUERY_LIMIT and attention_mask.shape[1] == 1:
        output = _packed_query_attention(query, key, value, attention_mask, groups, dropout, scaling)
    else:
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )
    return output.transpose(1, 2).contiguous(), None


def _packed_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor, groups: int,
    dropout: float, scaling: float | None,
) -> torch.Tensor:
    """Attention with each key/value head's `groups` query heads packed into one sequence: query `[B, H, T, D]`, key
    and value `[B, H_kv, S, D]`, mask `[B, 1, T, S]` -> `[B, H, T, D]`. Query head h = g * groups + r goes to key/value
    head g at packed positions r * T .. r * T + T - 1, each with the mask's rows 0..T-1."""
    batch, heads, length, head_dim = query.shape
    packed = query.reshape(batch, heads // groups, groups * length, head_dim)
    output = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask.repeat(1, 1, groups, 1), dropout_p=dropout, scale=scaling
    )
    return output.view(batch, heads, length, head_dim)


AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention_forward)
AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)


class GroupedQueryAttention:
    """Context manager: inside it, a model whose attention implementation is `sdpa` runs `gqa_sdpa_attention_forward`
    (see the module docstring); any other implementation is left alone."""

    def __init__(self, model: torch.nn.Module):
        self.config = model.config
        self.switched = self.config._attn_implementation == "sdpa"

    def __enter__(self) -> "GroupedQueryAttention":
        if self.switched:
            self.config._attn_implementation = GQA_SDPA
        return self

    def __exit__(self, *exc_info) -> None:
        if self.switched:
            self.config._attn_implementation = "sdpa"
