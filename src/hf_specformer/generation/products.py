"""Few-row matrix products on the CPU: the same `nn.Linear` functions, computed the way that streams the weight once.

A verification step feeds only B * (k + 1) rows through every linear layer of the target. For such few rows MKL
runs `x @ W^T` (what `nn.Linear` asks for) with a packing pass over the whole weight on every call, while `W @ x^T`
streams it once: faster from 2 up to about `FEW_ROWS` rows, and up to `FEW_HEAD_ROWS` for the vocabulary-sized head;
the same at 1 row. MKL's kernels favour an even or four-wide right-hand side, so the cost is not monotone in the rows
(at B = 1, k = 3 drafts cost what a 1-token forward does, k = 4 a third more). The measurements are in the README
(How it works).

`FewRowLinears` switches this on for the linear layers of given modules while the engine runs, and restores them
after. It serves plain batched decoding on the CPU as well (B rows per forward: 1.6x at B = 4), e.g.

    with FewRowLinears([model], head=model.get_output_embeddings()):
        model.generate(**inputs)

Only plain `nn.Linear` layers with float32/float64 weights on the CPU are touched (subclasses such as PEFT or
quantised layers, other dtypes and GPUs keep their own forward); inputs with more rows run `nn.Linear.forward`.
Outputs equal `nn.Linear`'s up to floating-point summation order.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from torch import nn

FEW_ROWS = 32
"""Up to this many input rows (all leading dimensions flattened), a linear layer runs as W @ x^T."""

FEW_HEAD_ROWS = 128
"""The same bound for the target's vocabulary-sized output layer."""

TRANSPOSED_DTYPES = (torch.float32, torch.float64)


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as `(W @ x^T)^T`: `[..., d_in]` -> `[..., d_out]`, contiguous."""
    rows = x.reshape(-1, x.shape[-1]).T  # [d_in, M]
    product = torch.mm(weight, rows) if bias is None else torch.addmm(bias[:, None], weight, rows)  # [d_out, M]
    return _transpose_to_contiguous(product).view(*x.shape[:-1], weight.shape[0])


def _transpose_to_contiguous(matrix: torch.Tensor) -> torch.Tensor:
    """`matrix.T.contiguous()` for a CPU matrix `[N, M]` with few columns. Outside autograd NumPy does it: torch's
    copy kernel is slow for this shape on the testbed ([1536, 5]: 39 vs 11 us; [49152, 5]: 860 vs 125 us, a few ms
    per target forward in all)."""
    if matrix.requires_grad:
        return matrix.T.contiguous()
    return torch.from_numpy(np.ascontiguousarray(matrix.numpy().T))


def _few_row_forward(linear: nn.Linear, max_rows: int, x: torch.Tensor) -> torch.Tensor:
    if x.numel() <= max_rows * x.shape[-1]:
        return transposed_linear(x, linear.weight, linear.bias)
    return nn.Linear.forward(linear, x)


def _eligible(module: nn.Module) -> bool:
    return (
        type(module) is nn.Linear
        and module.weight.device.type == "cpu"
        and module.weight.dtype in TRANSPOSED_DTYPES
        and "forward" not in module.__dict__
    )


class FewRowLinears:
    """Context manager: inside it, the eligible linear layers of `modules` compute few-row inputs as W @ x^T (see
    the module docstring); `head` (the target's output layer, one of them or not) gets `FEW_HEAD_ROWS`.

    Args:
        modules: models whose linear layers to switch (the target, the drafter).
        head: the layer that gets the larger row bound, or None.
    """

    def __init__(self, modules: list[nn.Module], head: nn.Module | None = None):
        self.linears = {id(m): m for module in modules for m in module.modules() if _eligible(m)}
        self.forwards = [
            (linear, partial(_few_row_forward, linear, FEW_HEAD_ROWS if linear is head else FEW_ROWS))
            for linear in self.linears.values()
        ]

    def __enter__(self) -> "FewRowLinears":
        for linear, forward in self.forwards:  # entered around every verification forward: no Module.__setattr__
            linear.__dict__["forward"] = forward
        return self

    def __exit__(self, *exc_info) -> None:
        for linear in self.linears.values():
            linear.__dict__.pop("forward", None)
