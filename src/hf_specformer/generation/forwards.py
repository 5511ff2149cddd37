"""The loop's target forward, the hidden states it records (`recorded_hidden_states`) and the layers switched around
it (`LoopLayers`)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Collection

import torch

from .attention import GroupedQueryAttention
from .linears import LinearSwitch


class LoopLayers:
    """The layers a speculative call switches: its linear layers (`linears.LinearSwitch`: few-row products on the
    CPU, packed verification) and, on the CPU, the target's attention (`attention.GroupedQueryAttention`).

    `installed()` puts them in place once per call; `speedups()` and `packed(selected)` switch them around single
    forwards. Switched off, every layer computes what the model's own forward does.

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


@contextlib.contextmanager
def recorded_hidden_states(model, indices: Collection[int]):
    """Context: records the hidden states at `indices` of the tuple that `output_hidden_states=True` would give for
    the forward run inside it, and only those. Yields a list of L + 1 entries, filled as the forward runs: at index 0
    the first decoder layer's input, at i in 1..L-1 layer i's output, at L the decoder's output (after its final
    norm); None where not recorded.

    Why not `output_hidden_states=True`: it keeps all L + 1 states `[B, T, d]` alive through the forward, where the
    drafter reads 4 and the companion 1. On a long padded prefill that costs 14% of the forward on the CPU testbed
    (SmolLM2, MT-bench, B = 32 rows of 243 columns, 31 states of 18 MB: 16.5 s, against 14.5 s recording 5 and
    14.2 s for the model's own forward). transformers' own selection by index (`output_hidden_states=[...]`) counts
    its indices differently across the versions this package supports, so the hooks here sit on the decoder's layers
    directly: a forward pre-hook on the first layer, forward hooks on the others and on the decoder."""
    decoder = model.get_decoder()
    num_layers = model.config.get_text_config().num_hidden_layers
    states: list[torch.Tensor | None] = [None] * (num_layers + 1)
    if any(not 0 <= index <= num_layers for index in indices):
        raise ValueError(f"Hidden-state indices {sorted(indices)} outside 0..{num_layers} (the target's layers).")

    def record_input(module, args, kwargs) -> None:
        states[0] = args[0] if args else kwargs["hidden_states"]

    def record_output(index: int):
        def hook(module, args, output) -> None:
            states[index] = output if isinstance(output, torch.Tensor) else output[0]  # a tuple or a ModelOutput
        return hook

    handles = []
    for index in indices:
        if index == 0:
            handles.append(decoder.layers[0].register_forward_pre_hook(record_input, with_kwargs=True))
        else:
            module = decoder if index == num_layers else decoder.layers[index - 1]
            handles.append(module.register_forward_hook(record_output(index)))
    try:
        yield states
    finally:
        for handle in handles:
            handle.remove()


def target_forward(model, input_ids, attention_mask, position_ids, cache, hidden_state_indices: Collection[int],
                   logits_to_keep):
    """One target forward of the loop: logits of the last `logits_to_keep` inputs (0: all), and as `hidden_states`
    the L + 1 entries of `recorded_hidden_states` at `hidden_state_indices` (none: no `hidden_states`). Run it inside
    `LoopLayers.speedups()` for the loop's speed on the CPU."""
    with recorded_hidden_states(model, hidden_state_indices) as states:
        output = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **cache_argument(model, cache),
        )
    if hidden_state_indices:
        output["hidden_states"] = tuple(states)
    return output
