"""The drafter's grouped RMSNorm in one kernel, `[N, G, d]` -> `[N, G * d]` (the concatenation the down projection
reads), rounding as its reference `SpecFormerGroupedRMSNorm` does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_rms_norm_kernel(input_ptr, weight_ptr, output_ptr, hidden_size, num_groups, eps,
                             BLOCK: tl.constexpr, COMPUTE: tl.constexpr):
    index = tl.program_id(0).to(tl.int64)  # one (position, group) per program
    group = index % num_groups
    columns = tl.arange(0, BLOCK)
    inside = columns < hidden_size
    x = tl.load(input_ptr + index * hidden_size + columns, mask=inside, other=0.0)
    values = x.to(COMPUTE)
    variance = tl.sum(values * values, axis=0) / hidden_size
    normalized = (values * tl.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + group * hidden_size + columns, mask=inside, other=0.0)
    tl.store(output_ptr + index * hidden_size + columns, weight * normalized, mask=inside)


def grouped_rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """hidden_states `[..., G, d]`, weight `[G, d]` -> `[..., G * d]`, without autograd."""
    *leading, num_groups, hidden_size = hidden_states.shape
    flat = hidden_states.contiguous().view(-1, hidden_size)
    output = torch.empty(*leading, num_groups * hidden_size, dtype=torch.promote_types(weight.dtype,
                         hidden_states.dtype), device=hidden_states.device)
    if flat.shape[0]:
        _grouped_rms_norm_kernel[(flat.shape[0],)](
            flat, weight.contiguous(), output, hidden_size, num_groups, eps, BLOCK=triton.next_power_of_2(hidden_size),
            COMPUTE=tl.float64 if hidden_states.dtype == torch.float64 else tl.float32
        )
    return output
