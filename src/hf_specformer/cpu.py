"""CPU products: faster few-row linear layers, packed inputs and grouped-query attention, for a whole call.

    with hf_specformer.cpu_products(target, drafter):
        target.generate(**inputs)                                   # plain decoding gains too
        hf_specformer.generate(target, **inputs, assistant_model=drafter)

Up to `FEW_ROWS` rows a float `nn.Linear` runs as `W @ x^T` where that was timed faster on this CPU (some MKL builds
pack the whole weight per `x @ W^T` call); inputs whose mask column is 0 are skipped (SV's packed verification), and
`sdpa` attention runs as `GQA_SDPA`. Outputs equal the models' own up to summation order; all is restored on exit.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial

import numpy as np
import torch
from torch import nn

from .attention import GQA_SDPA

FEW_ROWS = 32
"""Up to this many input rows (leading dimensions flattened) a linear layer runs as W @ x^T."""

FEW_HEAD_ROWS = 128
"""The same bound for the target's output layer, whose weight is the vocabulary's."""

CHOICE_MARGIN = 0.9
"""A shape runs as W @ x^T only where that took at most this share of x @ W^T's time (a margin over timing noise)."""


def padded_rows(rows: int) -> int:
    """Rows a few-row product computes: zero rows are added where MKL's W @ x^T is cheaper with them (1 -> 2, 3 ->
    4, 7 -> 8, beyond 8 the next multiple of 8; docs/log.md, few-row products)."""
    return -(-rows // 8) * 8 if rows > 8 else {1: 2, 3: 4, 7: 8}.get(rows, rows)


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` as `(W @ x^T)^T` over `padded_rows` rows: `[..., d_in]` -> `[..., d_out]`."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if padded_rows(count) > count:
        rows = torch.cat([rows, rows.new_zeros(padded_rows(count) - count, rows.shape[1])])
    product = torch.mm(weight, rows.T) if bias is None else torch.addmm(bias[:, None], weight, rows.T)
    product = product[:, :count]
    # NumPy transposes a tall, narrow matrix several times faster than torch's copy kernel
    transposed = product.T.contiguous() if product.requires_grad else torch.from_numpy(
        np.ascontiguousarray(product.numpy().T))
    return transposed.view(*x.shape[:-1], weight.shape[0])


_TRANSPOSED_FASTER: dict = {}
"""(d_out, d_in, rows, dtype) -> whether W @ x^T beat x @ W^T on this CPU (`transposed_is_faster`)."""


def transposed_is_faster(weight: torch.Tensor, rows: int) -> bool:
    """Whether `transposed_linear` beats `F.linear` for `rows` input rows of `weight` on this CPU, timed once per
    shape and process (the best of 5 calls each, as `torch.backends.cudnn.benchmark` picks kernels)."""
    key = (*weight.shape, rows, weight.dtype)
    if key not in _TRANSPOSED_FASTER:
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        with torch.no_grad():
            transposed, plain = (_best_seconds(partial(product, x, weight))
                                 for product in (transposed_linear, nn.functional.linear))
        _TRANSPOSED_FASTER[key] = transposed <= CHOICE_MARGIN * plain
    return _TRANSPOSED_FASTER[key]


def _best_seconds(call, repeats: int = 5) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


class _Products:
    """The linear layers of the models, switched for the block (see `cpu_products`)."""

    def __init__(self, models):
        heads = {id(m.get_output_embeddings()) for m in models if hasattr(m, "get_output_embeddings")}
        modules = [*models, *(m.draft_head() for m in models
                              if getattr(m, "is_bound", False) and hasattr(m, "draft_head"))]
        self.layers = list({id(m): m for model in modules for m in model.modules()
                            if isinstance(m, nn.Linear)}.values())
        self.max_rows = [(FEW_HEAD_ROWS if id(layer) in heads else FEW_ROWS) if _takes_few_rows(layer) else 0
                         for layer in self.layers]
        self.packing: tuple[torch.Size, torch.LongTensor] | None = None  # (inputs [B, T], kept flat index)

    def forward(self, layer: nn.Linear, inner, max_rows: int, x: torch.Tensor) -> torch.Tensor:
        if self.packing is not None and x.shape[:-1] == self.packing[0]:
            shape, index = self.packing
            kept = self.product(layer, inner, max_rows, x.reshape(-1, x.shape[-1]).index_select(0, index))
            return kept.new_zeros(shape.numel(), kept.shape[-1]).index_copy_(0, index, kept).view(*shape, -1)
        return self.product(layer, inner, max_rows, x)

    @staticmethod
    def product(layer: nn.Linear, inner, max_rows: int, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if max_rows and rows <= max_rows and transposed_is_faster(layer.weight, padded_rows(rows)):
            return transposed_linear(x, layer.weight, layer.bias)
        return inner(x)

    def start_packing(self, module, args, kwargs) -> None:
        """A model's forward pre-hook: pack the inputs that their own mask column hides (a 2D mask, or the diagonal of
        a 4D one's last T columns: boolean, or additive with 0 where kept)."""
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if ids is None or mask is None or mask.dim() not in (2, 4) or mask.device.type != "cpu":
            return
        length = ids.shape[1]
        if mask.dim() == 2:
            kept = mask[:, -length:].bool()
        else:
            diagonal = mask[:, 0, :, -length:].diagonal(dim1=1, dim2=2)  # [B, T]
            kept = diagonal if diagonal.dtype == torch.bool else diagonal == 0
        if not bool(kept.all()):
            self.packing = (ids.shape, kept.flatten().nonzero().squeeze(1))

    def stop_packing(self, *args) -> None:
        self.packing = None


def _takes_few_rows(layer: nn.Linear) -> bool:
    return type(layer) is nn.Linear and layer.weight.device.type == "cpu" and \
        layer.weight.dtype in (torch.float32, torch.float64) and "forward" not in layer.__dict__


@contextlib.contextmanager
def cpu_products(*models: nn.Module):
    """Inside the block, the CPU models among `models` (a target and its drafter or companion) run as the module
    docstring says; models elsewhere are left alone."""
    models = [model for model in models if next(model.parameters()).device.type == "cpu"]
    products, own, handles = _Products(models), [], []
    switched = [m for m in models if getattr(m.config, "_attn_implementation", None) == "sdpa"
                and hasattr(m, "set_attn_implementation")]
    try:
        for layer, max_rows in zip(products.layers, products.max_rows):
            own.append(layer.__dict__.get("forward"))
            inner = own[-1] if own[-1] is not None else partial(type(layer).forward, layer)
            layer.__dict__["forward"] = partial(products.forward, layer, inner, max_rows)
        for model in models:
            handles.append(model.register_forward_pre_hook(products.start_packing, with_kwargs=True))
            handles.append(model.register_forward_hook(products.stop_packing))
        for model in switched:
            model.set_attn_implementation(GQA_SDPA)
        yield
    finally:
        for model in switched:
            model.set_attn_implementation("sdpa")
        for handle in handles:
            handle.remove()
        for layer, forward in zip(products.layers, own):
            if forward is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.__dict__["forward"] = forward
