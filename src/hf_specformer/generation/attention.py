"""Grouped-query attention without copying the KV cache, for the verification forwards on the CPU.

A verification step feeds k + 1 queries per row with an attention mask (the ragged batch's holes). For several
queries and a mask, `transformers`' SDPA integration repeats the key/value heads of grouped-query models
(`repeat_kv`): every layer copies its whole cache, num_attention_heads / num_key_value_heads times, on every step.
On the CPU, torch's SDPA takes the mask and the grouped heads directly (`enable_gqa=True`) with the same result,
bit for bit, and several times faster over long caches (README, How it works).

`GroupedQueryAttention` switches a model that uses `sdpa` to this function for the length of a speculative call and
restores it after. transformers picks a layer's attention function from the shared `config._attn_implementation` on
every forward and offers no per-call choice, so the switch is that attribute, set once per call; since the function
equals SDPA's, bit for bit, another thread running the same model meanwhile gets the same results. On other devices
(where masked GQA would leave SDPA's fast kernels), for a single query (which `transformers` already handles without
copies) and without a mask it calls `transformers`' own SDPA function.
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
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


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
