"""The loop's target forward and the layers switched around it (`LoopLayers`)."""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from .attention import GroupedQueryAttention
from .linears import LinearSwitch


class LoopLayers:
    """The layers a speculative call switches: its linear layers (`linears.LinearSwitch`: few-row products on the
    CPU, packed verification) and, on the CPU, the target's attention (`attention.GroupedQueryAttention`).

    `installed()` puts them in place once per call; `speedups()` and `packed(selected)` switch them around single
    forwards. Switched off (a plain width-0 step), every layer computes what the model's own forward does.

    Args:
        model: the target.
        modules: every model the call runs (target, drafter, companion): their linear layers are switched.
        cpu_speedups: few-row products and grouped-query attention, on a CPU target only.
    """

    def __init__(self, model, modules: list[torch.nn.Module], cpu_speedups: bool = True):
        self.cpu_speedups = cpu_speedups and model.device.type == "cpu"
        head = model.get_output_embeddings() if self.cpu_speedups else None
        self.linears = LinearSwitch(modules, head=head, few_rows=self.cpu_speedups)
        self.attention = GroupedQueryAttention(model) if self.cpu_speedups else contextlib.nullcontext()

    @contextlib.contextmanager
    def installed(self):
        """Inside the block the switches are in place (off); the model's own layers and attention after."""
        with self.linears.installed(), self.attention:
            yield self

    def speedups(self):
        """Context: few-row products inside it (nothing off the CPU or with `cpu_speedups=False`)."""
        return self.linears.few_rows()

    def packed(self, selected: torch.BoolTensor, enabled: bool = True):
        """Context: packed verification of the inputs `selected` `[B, T]` (host) inside it (`LinearSwitch.packed`)."""
        return self.linears.packed(selected, enabled)


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
    with `output_hidden_states`. Run it inside `LoopLayers.speedups()` for the loop's speed on the CPU."""
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        output_hidden_states=output_hidden_states,
        logits_to_keep=logits_to_keep,
        **cache_argument(model, cache),
    )
