"""Triton kernels of the hot path and the dispatcher between them and their PyTorch references.

- `verification.py`: greedy verification (first mismatch between drafts and the target's argmax, per ragged row)
  and speculative sampling (accept with min(1, p/q), correction from norm(max(p - q, 0)), bonus from p), one
  program per row streaming the vocabulary in blocks, so no residual distribution is materialised. References:
  `verify_greedy` and `verify_sampling` in `generation/verification.py`, which call the kernels when they serve.
- `rms_norm.py`: the drafter's grouped RMSNorm (4 hooked states, each with its own scale) written straight into
  their concatenation. Reference: `SpecFormerGroupedRMSNorm` in `models/specformer/modeling_specformer.py`.

`HF_SPECFORMER_KERNELS` picks the implementation: `torch` (the references), `triton` (the kernels; on a CPU they run
under Triton's interpreter: start Python with `TRITON_INTERPRET=1`, since Triton reads it when it is first imported,
which loading a transformers model already does),
or `auto` (default: Triton for CUDA tensors when Triton imports, the references elsewhere). Where Triton is not
installed every backend falls back to the references, so remote code and CPU-only installs keep working.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import torch

KERNELS_ENV = "HF_SPECFORMER_KERNELS"
BACKENDS = ("auto", "triton", "torch")


def kernel_backend() -> str:
    """The backend asked for by `HF_SPECFORMER_KERNELS` (default `auto`); ValueError for another value."""
    backend = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"{KERNELS_ENV}={backend!r}; choose one of {BACKENDS}.")
    return backend


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether the kernels serve an input on `tensor`'s device under the current backend."""
    backend = kernel_backend()
    if backend == "torch" or not triton_available():
        return False
    if backend == "auto":
        return tensor.device.type == "cuda"
    if tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:  # Triton decides at import time whether its functions are interpreted
            raise ValueError(
                f"{KERNELS_ENV}=triton on the CPU runs the kernels in Triton's interpreter: start Python with "
                "TRITON_INTERPRET=1 (Triton was already imported without it)."
            )
        os.environ["TRITON_INTERPRET"] = "1"
    return True


def load(name: str):
    """The kernel module `hf_specformer.kernels.<name>`, imported on first use (after `use_triton` set the
    interpreter where needed)."""
    return importlib.import_module(f"{__name__}.{name}")
