"""Triton kernels of the hot path and the dispatcher between them and their PyTorch references.

Backends: `torch` (the references), `triton` (on a CPU with `TRITON_INTERPRET=1`), `auto` (Triton for CUDA tensors);
None reads `HF_SPECFORMER_KERNELS`. Without Triton every backend falls back to the references.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import torch

KERNELS_ENV = "HF_SPECFORMER_KERNELS"
BACKENDS = ("auto", "triton", "torch")


def kernel_backend(backend: str | None = None) -> str:
    """`backend`, or where it is None the one `HF_SPECFORMER_KERNELS` asks for (default `auto`); ValueError for a
    name not in `BACKENDS`."""
    source = "kernels" if backend is not None else KERNELS_ENV
    if backend is None:
        backend = os.environ.get(KERNELS_ENV, "auto")
    backend = backend.strip().lower() or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"{source}={backend!r}; choose one of {BACKENDS}.")
    return backend


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(tensor: torch.Tensor, backend: str | None = None) -> bool:
    """Whether the kernels serve an input on `tensor`'s device under `backend` (None: `kernel_backend()`'s).
    ValueError for `triton` on the CPU without `TRITON_INTERPRET=1` (Triton reads it once, at import)."""
    backend = kernel_backend(backend)
    if backend == "torch" or not triton_available():
        return False
    if backend == "auto":
        return tensor.device.type == "cuda"
    if tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("The triton kernel backend on the CPU runs the kernels in Triton's interpreter: start Python "
                         "with TRITON_INTERPRET=1.")
    return True


def load(name: str):
    """The kernel module `hf_specformer.kernels.<name>`, imported on first use."""
    return importlib.import_module(f"{__name__}.{name}")
