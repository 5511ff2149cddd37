"""Few-row matrix products on the CPU: the same `nn.Linear` functions, computed the way that streams the weight once.

A verification step feeds only B * (k + 1) rows through every linear layer of the target. For such few rows MKL
runs `x @ W^T` (what `nn.Linear` asks for) with a packing pass over the whole weight on every call, while `W @ x^T`
streams it once. Measured on the 2-core testbed (float32, the 210 decoder linears of SmolLM2-135M, weights out of
cache), per forward: 1 row 38 vs 37 ms (decoding one row is neither slowed nor sped up), 4 rows 70 vs 43 ms, 5 rows
61 vs 37 ms, 16 rows 91 vs 66 ms, 32 rows 114 vs 90 ms, 64 rows 136 vs 142 ms, hence `FEW_ROWS`. The
vocabulary-sized head gains further (V = 49152: 5 rows 21.4 vs 6.7 ms, 40 rows 38.8 vs 27.6 ms, 160 rows 90 vs
86 ms, 320 rows 169 vs 269 ms), hence `FEW_HEAD_ROWS`.

The cost of `W @ x^T` is not monotone in the rows: measured again this way (same 210 linears, then the head), for
1..9 rows: 38, 37, 47, 38, 51, 62, 75, 67, 81 ms and 9.5, 7.3, 10.1, 7.4, 10.2, 13.3, 16.6, 13.8, 16.4 ms. MKL's
kernels favour an even or four-wide right-hand side, so at B = 1 verifying k = 3 drafts (4 inputs) costs what a
1-token forward does, while k = 4 (5 inputs) costs a third more; the shipped drafter's default k is 3.

These are isolated timings. Inside the decoding loop the 16-row case did not hold: at B = 16 (SmolLM2, MT-bench,
128 tokens, the engine forced to run, nearly all steps of width 0, so 16 rows), a call's 126 target forwards took
20.2 s with the switch and 18.3 s with the bound lowered to 8 rows; a call without the switch took 17.5 s for its
127. Timed alone at that batch, the same forward costs 87 ms with the switch and 89 ms without. The cause is not
known. It does not reach plain `generate` calls: from B = 8 on the goodput scheduler runs
transformers' plain loop, without this switch, on the testbed.

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
