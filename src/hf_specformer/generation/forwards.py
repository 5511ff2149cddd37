"""The loop's target forward and the CPU speed-ups entered around it (`FewRowLinears`, `GroupedQueryAttention`)."""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from .attention import GroupedQueryAttention
from .products import FewRowLinears


class CpuPatches:
    """The loop's CPU speed-ups (`FewRowLinears` over `modules`, `GroupedQueryAttention` of `model`), a context
    manager entered around each forward that gains from them and restored after it, also on exceptions; nothing
    when `enabled` is False or the model is not on the CPU."""

    def __init__(self, model, modules: list[torch.nn.Module], enabled: bool = True):
        self.patches = []
        if enabled and model.device.type == "cpu":
            self.patches = [FewRowLinears(modules, head=model.get_output_embeddings()), GroupedQueryAttention(model)]
        self.stack: list[contextlib.ExitStack] = []

    def __enter__(self) -> "CpuPatches":
        stack = contextlib.ExitStack()
        for patch in self.patches:
            stack.enter_context(patch)
        self.stack.append(stack)
        return self

    def __exit__(self, *exc_info) -> None:
        self.stack.pop().close()


def cpu_patches(model, modules: list[torch.nn.Module], enabled: bool = True) -> CpuPatches:
    """`CpuPatches(model, modules, enabled)`, for a `with` block."""
    return CpuPatches(model, modules, enabled)


@functools.cache
def cache_keyword(model_class: type) -> str:
    """The name under which a model's `forward` takes its KV cache: `cache` from transformers 5.24 (where
    `past_key_values` is deprecated), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_argument(model: torch.nn.Module, cache) -> dict:
    """`{name: cache}` to pass `cache` to `model(...)` under the name its `forward` takes (`cache_keyword`)."""
    return {cache_keyword(type(model)): cache}


def target_forward(model, input_ids, attention_mask, position_ids, cache, output_hidden_states, logits_to_keep):
    """One target forward of the loop: logits of the last `logits_to_keep` inputs (0: all), and the hidden states
    with `output_hidden_states`. Run it inside `cpu_patches` for the loop's speed on the CPU."""
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        output_hidden_states=output_hidden_states,
        logits_to_keep=logits_to_keep,
        **cache_argument(model, cache),
    )
