"""Reads from the accelerator to the host, counted.

On a GPU a read of a tensor's values on the host waits for every queued kernel: a synchronisation, which stalls the
launch of the next ones. The engine keeps them to two per step, both through one `HostReads` per call: the goodput
scheduler's read of the step's estimates (it chooses on the host) and the step's counts after verification (rows
still live, the longest row's cache, tokens committed). The count is reported as `SpecStats.host_reads`. Steps read
more only where a feature needs the values: a streamer (the tokens it prints), stop strings and processors that read
each row's prefix.
"""

from __future__ import annotations

import torch


class HostReads:
    """Device-to-host copies of one call; `count` says how many were made."""

    def __init__(self):
        self.count = 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the CPU (a synchronisation on an accelerator)."""
        self.count += 1
        return tensor.cpu()
