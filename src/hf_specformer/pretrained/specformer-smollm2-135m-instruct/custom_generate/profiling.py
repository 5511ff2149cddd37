"""Step costs for the goodput scheduler: timing the loop's steps on this machine, what they depend on, the cache.

`measure_step_costs` times the forwards the loop runs (`bench` and the tests call it; a call never profiles), and
a call without a cached profile learns the costs from its own steps and caches them for the next (`remember_costs`).
"""

from __future__ import annotations

import torch

from .caching import PreallocatedCache, kv_heads
from .drafting import Proposer
from .forwards import LoopLayers, target_forward
from .costs import PROFILE_CONTEXT, StepCostModel, cached_step_costs, profile_step_costs, step_costs_path
from .scheduling import GoodputSchedule, Schedule


STEP_COSTS_SCHEME = 3
"""Changed whenever the forwards whose costs are cached, or what is cached, change (2: plain steps run with the CPU
speed-ups; 3: learnt costs cached for the call's own batch size only), so that costs cached under an older scheme are
learnt anew rather than read."""


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _random_cache(config, batch_size: int, length: int, capacity: int, dtype, device) -> PreallocatedCache:
    """A `PreallocatedCache` of `length` random key/value columns per row in every layer (for timing only)."""
    config = config.get_text_config()
    heads, head_dim = kv_heads(config)
    shape = (batch_size, heads, length, head_dim)
    cache = PreallocatedCache(config.num_hidden_layers, capacity)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device),
                     layer)
    return cache


def measure_step_costs(
    model, proposer: Proposer, layers: LoopLayers, batch_sizes: list[int], max_width: int
) -> StepCostModel:
    """Times, over a cache of `PROFILE_CONTEXT` random columns at each batch size: the loop's target forward of
    w + 1 inputs per row (w = 0..max_width, with the hidden states the proposer reads and the float32 argmax of its
    logits) with `layers` installed and sped up (the loop's CPU speed-ups); the proposer's drafting, likewise; and
    plain decoding's forward of one input per row with the same speed-ups and no hidden states (what `_plain_decode`
    runs)."""
    device, vocab = model.device, model.config.get_text_config().vocab_size
    caches = {}

    def forward(batch_size: int, width: int, hidden_state_indices: frozenset[int]) -> None:
        if batch_size not in caches:
            caches.clear()
            caches[batch_size] = _random_cache(model.config, batch_size, PROFILE_CONTEXT,
                                               PROFILE_CONTEXT + max_width + 1, model.dtype, device)
        cache = caches[batch_size]
        ids = torch.randint(vocab, (batch_size, width + 1), device=device)
        mask = torch.ones(batch_size, PROFILE_CONTEXT + width + 1, dtype=torch.long, device=device)
        positions = PROFILE_CONTEXT + torch.arange(width + 1, device=device).expand(batch_size, -1)
        output = target_forward(model, ids, mask, positions, cache, hidden_state_indices, 0)
        output.logits.float().argmax(-1)
        cache.crop(-(width + 1))

    def step(batch_size: int, width: int) -> None:
        with layers.installed(), layers.speedups():
            forward(batch_size, width, proposer.hidden_state_indices)

    def draft(batch_size: int) -> None:
        with layers.installed(), layers.speedups():
            proposer.profile_draft(batch_size)

    def plain(batch_size: int) -> None:
        with layers.installed(), layers.speedups():
            forward(batch_size, 0, frozenset())

    return profile_step_costs(step, draft, batch_sizes, max_width, lambda: _synchronize(device), plain=plain)


def step_cost_description(model, proposer: Proposer, cpu_speedups: bool) -> dict:
    """What the step costs depend on: the target's configuration, dtype, device, threads, the proposer and whether
    the CPU speed-ups run."""
    device = model.device
    return {
        "target": model.config.get_text_config().to_diff_dict(),
        "dtype": str(model.dtype),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "torch": torch.__version__,
        "attention": model.config._attn_implementation,
        "proposer": proposer.cost_description(),
        "context": PROFILE_CONTEXT,
        "cpu_speedups": cpu_speedups,
        "scheme": STEP_COSTS_SCHEME,
    }


def step_cost_profile(model, proposer, patched: bool, batch_size: int, step_costs) -> StepCostModel | None:
    """The step costs given, or those cached for this machine if they cover the batch; None: none (the goodput
    scheduler then learns them from the call's own steps, `remember_costs`; a call never profiles)."""
    if step_costs is not None:
        return StepCostModel.from_value(step_costs)
    description = step_cost_description(model, proposer, patched)
    return cached_step_costs(description, batch_size, proposer.num_draft_tokens)


def remember_costs(scheduler: Schedule, model, proposer, patched: bool, batch_size: int) -> None:
    """Caches the step costs a goodput call learnt without a profile (`OnlineStepCosts.learnt`) for the batch size it
    ran at, so the next call at that size can choose between the engine and plain decoding before it starts
    (`StepCostModel.covers`: other sizes learn anew). Only that size: the call's one line of verification costs is
    fitted to its steps at that size. Written also for the sizes its rows shrank to as they finished, it priced B = 1
    at 1.46 plain steps for one draft where 1.04 was measured, for every later call (a cached profile is never
    learnt anew)."""
    costs = scheduler.costs if isinstance(scheduler, GoodputSchedule) and scheduler.feedback else None
    if costs is None or not costs.learnt or batch_size not in costs.plain_batch_sizes:
        return
    description = step_cost_description(model, proposer, patched)
    path = step_costs_path(description)
    try:
        older = StepCostModel.load(path) if path.exists() else None
    except ValueError:
        older = None
    learnt = StepCostModel.learnt(costs, [batch_size], proposer.num_draft_tokens, description)
    learnt.merged_into(older).save(path)
