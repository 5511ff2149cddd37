"""The engine reads the device at most twice per step (`host.py`), and nothing else in its loop waits for it."""

from __future__ import annotations

import traceback

import pytest
import torch
from conftest import make_drafter, make_target
from helpers import PAD, SimulatedClock, make_batch, optimistic_table
from torch.utils._python_dispatch import TorchDispatchMode

from hf_specformer import generate
from hf_specformer.generation import engine

WAITING_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
               "aten._unique2.default", "aten.unique_consecutive.default", "aten.unique_dim.default"}
"""Operators whose result needs the device's values on the host (`.item()`, `int()`, data-dependent shapes)."""


HOST_MODULES = ("scheduling.py", "feedback.py", "linears.py", "masking_utils.py")
"""Where a wait is not one: the schedule, its feedback and the packed inputs' selection compute on the host by
contract (`choose` takes the estimates once read, `observe` host counts, `LinearSwitch.packed` the host's counts),
and transformers' mask preparation is what plain `generate` runs too."""


class WaitingOps(TorchDispatchMode):
    """Counts operators that wait for the device, boolean-mask indexing included (a hidden `nonzero`), outside
    `HOST_MODULES`. On the CPU they cost nothing, but each is a synchronisation on a GPU. `.cpu()` and `.tolist()`
    do not dispatch on the CPU, which is why the engine's own reads go through `HostReads` and are counted there."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        boolean_index = str(func).startswith("aten.index") and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool
            for arg in args if isinstance(arg, (list, tuple)) for index in arg
        )
        if str(func) in WAITING_OPS or boolean_index:
            self.count += not any(frame.filename.endswith(HOST_MODULES) for frame in traceback.extract_stack())
        return func(*args, **kwargs)


def _speculate(target, drafter, input_ids, mask, max_new_tokens, **kwargs):
    with WaitingOps() as waiting:
        output = generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=drafter,
                          do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=PAD, eos_token_id=None,
                          return_dict_in_generate=True, **kwargs)
    return output.speculation_stats, waiting.count


@pytest.mark.parametrize("options", [
    {"schedule": "goodput", "lookup_ngram_size": 3},
    {"schedule": "goodput", "suffix_index": True},
    {"schedule": "goodput", "packed_verification": False},
    {"schedule": "fixed", "num_draft_tokens": 3},
    {"schedule": "fixed", "confidence_threshold": 0.2},
], ids=["goodput-lookup", "goodput-suffix", "goodput-padded", "fixed", "fixed-threshold"])
def test_at_most_two_host_reads_per_step_and_no_other_wait_that_grows_with_steps(options, monkeypatch):
    """Ragged rows without EOS (no row retires before the end), with the cost feedback and its plain steps: the
    engine's counted reads stay within two per step plus the prefill's one, and the operators that wait for the
    device anywhere in the call (transformers' input preparation included) do not grow with the number of steps.
    On a simulated clock, so that drafting pays whatever the machine's load (real timings of a tiny drafter can say
    it never does, and then no step verifies drafts)."""
    monkeypatch.setattr(engine, "StepClock", SimulatedClock)
    target = make_target("llama")
    drafter = make_drafter(target, draft_length=4)
    drafter.config.acceptance_table = optimistic_table("confidence")
    input_ids, mask = make_batch(4, seed=3)
    short, waits_short = _speculate(target, drafter, input_ids, mask, 8, **options)
    long, waits_long = _speculate(target, drafter, input_ids, mask, 40, **options)
    for stats in (short, long):
        assert stats.steps > 0 and stats.host_reads <= 2 * stats.steps + 1, (stats.host_reads, stats.steps)
    assert long.steps > short.steps + 10 and long.drafted > 0
    assert waits_long == waits_short, (waits_short, waits_long)
