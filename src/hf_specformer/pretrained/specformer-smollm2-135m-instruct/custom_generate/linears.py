"""The loop's linear layers, switched per forward between their own forward, few-row products and packed inputs.

**Few-row products (CPU).** A verification step feeds only B * (w + 1) rows through every linear layer. For so few
rows MKL computes `x @ W^T` (what `nn.Linear` asks for) with a packing pass over the whole weight on every call,
while `W @ x^T` streams it once: faster from 2 up to `FEW_ROWS` rows (`FEW_HEAD_ROWS` for the vocabulary-sized
head), the same at 1 row (measurements: README, How it works). Only plain `nn.Linear` layers with float32/float64
weights on the CPU and no forward of their own (PEFT, quantised or hooked layers keep theirs) take it; outputs equal
`nn.Linear`'s up to summation order.

**Packed inputs.** A verification forward is a rectangle `[B, w + 1]`: a row that verifies fewer drafts than the
widest feeds padding inputs after them. Speculative Verification verifies variable-length inputs without padding
(arXiv 2509.24328, section 6). The attention needs the rectangle (each row has its own cache), but the linear layers,
nearly all of the multiply-adds, work input by input, so they compute the selected inputs only and write zeros at
the others. The output cannot change: the selection is a prefix of each row (its last committed token and the drafts
it verifies), so under the causal mask no selected input attends to an unselected one; an unselected input's logits
are never read and it is never accepted, so `RaggedBatch.commit_cache` hides its cache column from every later
query (the drafter reads hidden states at accepted inputs only). A prefill packs the same way: the selection is
each row's real prompt tokens (left padding), which attend to no padding column, and only the last column's logits
are read. Only inputs shaped like the selection `[B, T, d_in]` are packed; any other input (reshaped or routed, or
the one-token steps after a packed prefill) runs the layer as it is.

`LinearSwitch` installs one forward on every linear layer of the given modules for the length of a call
(`installed()`, restored after it, also on exceptions); each forward of the loop then flips the switch
(`few_rows()`, `packed(selected)`): an attribute write, not a rebinding of every layer per forward. Switched off, a
layer computes what its own forward does. An instance forward rather than a wrapper module (PEFT's `base_layer`
pattern) keeps the model's module tree and `state_dict` keys unchanged during the call and costs a switched-off
layer one Python call, not one more module call (about 1 ms per forward over SmolLM2's 211 layers).
"""

from __future__ import annotations

import contextlib
from functools import partial

import numpy as np
import torch
from torch import nn

FEW_ROWS = 32
"""Up to this many input rows (all leading dimensions flattened), a linear layer runs as W @ x^T."""

FEW_HEAD_ROWS = 128
"""The same bound for the target's vocabulary-sized output layer."""

TRANSPOSED_DTYPES = (torch.float32, torch.float64)


def padded_rows(rows: int) -> int:
    """The rows a few-row product of `rows` rows computes: zero rows are added where MKL's W @ x^T (AVX2) is cheaper
    with them. Over SmolLM2's 210 decoder linears (float32, weights out of cache, best of 3) 1 to 9 rows cost 25.6,
    11.1, 14.2, 12.2, 18.5, 23.1, 26.8, 26.3, 30.1 ms, 12 rows 44.2, 15 68.6, 16 34.7, 17 47.6, 23 71.8, 24 47.3,
    31 84.8, 32 50.0: beyond 8 rows a multiple of 8 is cheapest, below it 2 and 4 rows are; an earlier day's
    figures (README, How it works: 38, 37, 47, 38, 51, 62, 75, 67, 81 ms for 1 to 9, 66 for 16) show the same
    steps. So 1 -> 2, 3 -> 4, 7 -> 8 and beyond 8 the next multiple of 8."""
    if rows > 8:
        return -(-rows // 8) * 8
    return {1: 2, 3: 4, 7: 8}.get(rows, rows)


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as `(W @ x^T)^T` over `padded_rows` rows: `[..., d_in]` ->
    `[..., d_out]`, contiguous."""
    rows = x.reshape(-1, x.shape[-1])  # [M, d_in]
    count = rows.shape[0]
    padded = padded_rows(count)
    if padded > count:
        rows = torch.cat([rows, rows.new_zeros(padded - count, rows.shape[1])])
    product = torch.mm(weight, rows.T) if bias is None else torch.addmm(bias[:, None], weight, rows.T)  # [d_out, P]
    return _transpose_to_contiguous(product[:, :count]).view(*x.shape[:-1], weight.shape[0])


def _transpose_to_contiguous(matrix: torch.Tensor) -> torch.Tensor:
    """`matrix.T.contiguous()` for a CPU matrix `[N, M]` with few columns. Outside autograd NumPy does it: torch's
    copy kernel is slow for this shape on the testbed ([1536, 5]: 39 vs 11 us; [49152, 5]: 860 vs 125 us)."""
    if matrix.requires_grad:
        return matrix.T.contiguous()
    return torch.from_numpy(np.ascontiguousarray(matrix.numpy().T))


def _takes_few_rows(layer: nn.Linear) -> bool:
    return (
        type(layer) is nn.Linear
        and layer.weight.device.type == "cpu"
        and layer.weight.dtype in TRANSPOSED_DTYPES
        and "forward" not in layer.__dict__
    )


class LinearSwitch:
    """The linear layers of `modules`, switchable per forward (see the module docstring).

        switch = LinearSwitch([target, drafter], head=target.get_output_embeddings())
        with switch.installed():              # once per call
            with switch.few_rows():           # around a forward that gains from few-row products
                ...
            with switch.packed(selected):     # selected: [B, T] bool on the host, a prefix of each row
                ...

    Args:
        modules: models whose `nn.Linear` layers (subclasses included) to switch.
        head: the layer that gets `FEW_HEAD_ROWS`, or None.
        few_rows: whether `few_rows()` may switch products (False: it does nothing, e.g. on GPUs).
    """

    def __init__(self, modules: list[nn.Module], head: nn.Module | None = None, few_rows: bool = True):
        layers = {id(m): m for module in modules for m in module.modules() if isinstance(m, nn.Linear)}
        self.layers = list(layers.values())
        self.max_rows = [
            (FEW_HEAD_ROWS if layer is head else FEW_ROWS) if few_rows and _takes_few_rows(layer) else 0
            for layer in self.layers
        ]
        self.few_rows_on = False
        self.packing: tuple[torch.Size, torch.LongTensor] | None = None  # (input shape [B, T], selected flat index)

    @contextlib.contextmanager
    def installed(self):
        """Inside the block every layer runs through the switch (off until flipped); their own forwards after."""
        own = [layer.__dict__.get("forward") for layer in self.layers]
        try:
            for layer, forward, max_rows in zip(self.layers, own, self.max_rows):
                inner = forward if forward is not None else partial(type(layer).forward, layer)
                layer.__dict__["forward"] = partial(self._forward, layer, inner, max_rows)
            yield self
        finally:
            for layer, forward in zip(self.layers, own):
                if forward is None:
                    layer.__dict__.pop("forward", None)
                else:
                    layer.__dict__["forward"] = forward

    @contextlib.contextmanager
    def few_rows(self):
        """Inside the block, few-row inputs of the eligible layers run as W @ x^T."""
        self.few_rows_on = True
        try:
            yield self
        finally:
            self.few_rows_on = False

    @contextlib.contextmanager
    def packed(self, selected: torch.BoolTensor, enabled: bool = True):
        """Inside the block, layer inputs shaped `[*selected.shape, d_in]` are computed at the True positions only
        (zeros elsewhere); nothing changes when `enabled` is False or every position is selected. `selected` is on
        the host, so choosing the inputs reads nothing from the device."""
        if not enabled or not self.layers or bool(selected.all()):
            yield self
            return
        index = selected.flatten().nonzero().squeeze(1).to(self.layers[0].weight.device, non_blocking=True)
        self.packing = (selected.shape, index)
        try:
            yield self
        finally:
            self.packing = None

    def _forward(self, layer: nn.Linear, inner, max_rows: int, x: torch.Tensor) -> torch.Tensor:
        if self.packing is not None and x.shape[:-1] == self.packing[0]:
            shape, index = self.packing
            selected = self._product(layer, inner, max_rows, x.reshape(-1, x.shape[-1]).index_select(0, index))
            output = selected.new_zeros(shape.numel(), selected.shape[-1])
            return output.index_copy_(0, index, selected).view(*shape, selected.shape[-1])
        return self._product(layer, inner, max_rows, x)

    def _product(self, layer: nn.Linear, inner, max_rows: int, x: torch.Tensor) -> torch.Tensor:
        if self.few_rows_on and max_rows and x.numel() <= max_rows * x.shape[-1]:
            return transposed_linear(x, layer.weight, layer.bias)
        return inner(x)


@contextlib.contextmanager
def few_row_products(modules: list[nn.Module], head: nn.Module | None = None):
    """Few-row products for every forward inside the block, outside the engine too (plain batched decoding on the
    CPU gains from them: 1.6x at B = 4), e.g.

        with few_row_products([model], head=model.get_output_embeddings()):
            model.generate(**inputs)
    """
    switch = LinearSwitch(modules, head)
    with switch.installed(), switch.few_rows():
        yield switch
