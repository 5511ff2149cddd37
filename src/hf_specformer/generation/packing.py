"""Packed verification: the target's linear layers compute only the inputs a step verifies.

The engine's verification forward is a rectangle `[B, w + 1]`: w is the widest row's count of verified drafts, and a
row that verifies fewer drafts feeds padding inputs after them. Speculative Verification verifies variable-length
inputs without padding (arXiv 2509.24328, section 6), so a step costs what its verified tokens cost. In a
`transformers` model the attention needs the rectangle (each row has its own cache), but the linear layers, which
do nearly all the multiply-adds (SmolLM2-135M at a 300-token context: about 93% per input), work input by input.
`PackedLinears` runs them on the selected inputs only and writes zeros at the others.

Why the output cannot change: an unselected input of row b comes after all of b's selected inputs in the step (the
selection is a prefix of each row: its last committed token and the drafts it verifies). Under the causal mask no
selected input attends to it; its logits are never read (verification reads positions 0..n_b); it is never
accepted, so `RaggedBatch.commit_cache` hides its cache column from every later query, in the target's cache and in
the drafter's, which reads hidden states only at accepted inputs. What the padding computes is therefore never
seen; computing zeros there, rather than the linear maps of padding, changes nothing that is.

Only layers that are `nn.Linear` (or subclasses) are switched, and only for inputs shaped `[B, w + 1, d_in]` like
the step's; every other input (a reshaped or routed one) runs the layer as it is. The switch wraps whatever forward a
layer has (`FewRowLinears`' on the CPU), so the packed rows still take the few-row path there.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch import nn


def _packed_forward(inner, shape: torch.Size, index: torch.LongTensor, x: torch.Tensor) -> torch.Tensor:
    """`inner(x)` at the inputs `index` of the flattened leading dimensions `shape`, zeros elsewhere."""
    if x.shape[:-1] != shape:
        return inner(x)
    selected = inner(x.reshape(-1, x.shape[-1]).index_select(0, index))  # [M, d_out]
    output = selected.new_zeros(shape.numel(), selected.shape[-1])
    return output.index_copy_(0, index, selected).view(*shape, selected.shape[-1])


class PackedLinears:
    """The linear layers of `model`, switchable to packed inputs for one forward at a time (see the module
    docstring).

        packed = PackedLinears(target)
        with packed.select(selected):  # selected: [B, T] bool, a prefix of each row
            output = target(...)
    """

    def __init__(self, model: nn.Module):
        self.linears = [module for module in model.modules() if isinstance(module, nn.Linear)]

    @contextlib.contextmanager
    def select(self, selected: torch.BoolTensor, packed: bool = True):
        """Inside the block, linear inputs shaped `[*selected.shape, d_in]` are computed at the True positions only
        (the others give zeros); nothing changes when `packed` is False or every position is selected. `selected`
        is on the host, so choosing the inputs reads nothing from the device."""
        if not packed or not self.linears or bool(selected.all()):
            yield
            return
        index = selected.flatten().nonzero().squeeze(1).to(self.linears[0].weight.device, non_blocking=True)
        own = [linear.__dict__.get("forward") for linear in self.linears]
        try:
            for linear in self.linears:
                linear.forward = partial(_packed_forward, linear.forward, selected.shape, index)
            yield
        finally:
            for linear, forward in zip(self.linears, own):
                if forward is None:
                    linear.__dict__.pop("forward", None)
                else:
                    linear.forward = forward
