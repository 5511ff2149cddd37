"""The engine reads the device once per step (`engine._Call.read`), and nothing else in its loop waits for it: on the
CPU through the operators that would wait on a GPU, on CUDA (`gpu` marker) through torch's sync debug mode."""

from __future__ import annotations

import collections
import traceback
import warnings

import pytest
import torch
from conftest import make_drafter, make_target
from helpers import PAD, make_batch, optimistic_table
from test_scheduler import SimulatedClock
from torch.utils._python_dispatch import TorchDispatchMode

from hf_specformer import generate
from hf_specformer.generation import engine

WAITING_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
               "aten._unique2.default", "aten.unique_consecutive.default", "aten.unique_dim.default"}
"""Operators whose result needs the device's values on the host (`.item()`, `int()`, data-dependent shapes)."""


HOST_MODULES = ("scheduler.py", "masking_utils.py")
"""Where a wait is not one: the schedule computes on the host by contract (`choose` takes the scores once read,
`observe` host counts), and transformers' mask preparation is what plain `generate` runs too."""


class WaitingOps(TorchDispatchMode):
    """Counts operators that wait for the device, boolean-mask indexing included (a hidden `nonzero`), outside
    `HOST_MODULES`. On the CPU they cost nothing, but each is a synchronisation on a GPU. `.cpu()` and `.tolist()`
    do not dispatch on the CPU, which is why the engine's own reads go through `_Call.read` and are counted there."""

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
    """-> the call's stats, its waiting operators and its prefill forwards (the target's forwards but the steps)."""
    forwards = []
    handle = target.register_forward_hook(lambda *args: forwards.append(1))
    with WaitingOps() as waiting:
        output = generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=drafter,
                          do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=PAD, eos_token_id=None,
                          return_dict_in_generate=True, speculation_config=kwargs)
    handle.remove()
    return output.speculation_stats, waiting.count, len(forwards) - output.speculation_stats.steps


class CudaWaits:
    """Every operation that waits for the CUDA device, as torch's sync debug mode reports it (device-to-host reads,
    and blocking host-to-device copies, which no dispatch mode sees), counted by the innermost frame of this
    package or of transformers; a wait inside the engine's counted read is counted as `read`, and transformers' check
    of the 2D mask (`_ignore_causal_mask_sdpa`, once per forward, in plain `generate` too) as `masking_utils.py`."""

    def __init__(self):
        self.places = collections.Counter()

    def __enter__(self) -> "CudaWaits":
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self.record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc_info):
        torch.cuda.set_sync_debug_mode("default")
        self.warnings.__exit__(*exc_info)

    def record(self, message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        frames = [frame for frame in traceback.extract_stack()[:-1] if "/hf_specformer/" in frame.filename
                  or "/transformers/" in frame.filename]
        host_read = any(frame.filename.endswith("engine.py") and frame.name == "read" for frame in frames)
        mask_check = bool(frames) and frames[-1].filename.endswith("masking_utils.py")
        place = "read" if host_read else "masking_utils.py" if mask_check else (
            "{}:{} {}".format(*frames[-1][:3]) if frames else "elsewhere")
        self.places[place] += 1


LOOP_OPTIONS = [
    {"schedule": "goodput", "lookup_ngram_size": 3},
    {"schedule": "goodput", "suffix_index": True},
    {"schedule": "fixed", "num_draft_tokens": 3},
    {"schedule": "fixed", "confidence_threshold": 0.2},
    {"schedule": "fixed", "max_batch_size": 2},
]
LOOP_IDS = ["goodput-lookup", "goodput-suffix", "fixed", "fixed-threshold", "fixed-continuous"]


@pytest.mark.parametrize("options", LOOP_OPTIONS, ids=LOOP_IDS)
def test_one_host_read_per_step_and_no_other_wait_that_grows_with_steps(options, monkeypatch):
    """Ragged rows without EOS (no row ends before the others), with learnt costs and their plain steps: the engine
    reads once per step and once per prefill forward, and the operators that wait for the device anywhere in the call
    (transformers' input preparation included) do not grow with the number of steps. On a simulated clock, so that
    drafting pays whatever the machine's load."""
    monkeypatch.setattr(engine, "StepClock", SimulatedClock)
    target = make_target("llama")
    drafter = make_drafter(target, draft_length=4)
    drafter.config.acceptance_table = optimistic_table("confidence")
    input_ids, mask = make_batch(4, seed=3)
    short, waits_short, prefills_short = _speculate(target, drafter, input_ids, mask, 8, **options)
    long, waits_long, prefills_long = _speculate(target, drafter, input_ids, mask, 40, **options)
    for stats, prefills in ((short, prefills_short), (long, prefills_long)):
        assert 1 <= prefills <= 4 and stats.steps > 0, (prefills, stats.steps)
        assert stats.host_reads <= stats.steps + prefills, (stats.host_reads, stats.steps, prefills)
    assert long.steps > short.steps + 10 and long.drafted > 0
    assert waits_long == waits_short, (waits_short, waits_long)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("options", LOOP_OPTIONS, ids=LOOP_IDS)
def test_on_cuda_the_loop_waits_for_the_device_only_in_its_counted_reads(options, monkeypatch):
    """The same calls on CUDA: every wait that grows with the number of steps is the engine's one read per step, or
    transformers' mask check, once per target forward (as in plain `generate`)."""
    monkeypatch.setattr(engine, "StepClock", SimulatedClock)
    target = make_target("llama").to("cuda")
    drafter = make_drafter(target, draft_length=4)
    drafter.config.acceptance_table = optimistic_table("confidence")
    input_ids, mask = (tensor.to("cuda") for tensor in make_batch(4, seed=3))
    waits = {}
    for max_new_tokens in (8, 40):
        with CudaWaits() as cuda_waits:
            stats, _, prefills = _speculate(target, drafter, input_ids, mask, max_new_tokens, **options)
        waits[max_new_tokens] = (stats, cuda_waits.places, prefills)
    (short, short_places, _), (long, long_places, prefills) = waits[8], waits[40]
    assert long.steps > short.steps + 10 and long.drafted > 0
    growing = {place: (short_places[place], count) for place, count in long_places.items()
               if place not in ("read", "masking_utils.py") and count > short_places[place]}
    assert not growing, f"waits that grow with the steps, (8 tokens, 40 tokens) by place: {growing}"
    assert 0 < long_places["read"] <= long.steps + prefills + 1, (long_places, long.steps)
    assert long_places["masking_utils.py"] <= long.steps + prefills, (long_places, long.steps)
