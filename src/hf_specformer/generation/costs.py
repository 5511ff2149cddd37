"""Step costs: t(B, w) of a verification step, t_d(B) of drafting and t_plain(B) of a plain step, measured on this
machine (`profile_step_costs`, run by `profiling.measure_step_costs`) and cached on disk per target, dtype, device
and drafter (`cached_step_costs`). The goodput scheduler plans with them (`scheduling.py`), and with cost feedback
refines them from the call's own steps (`feedback.OnlineStepCosts`).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .feedback import OnlineStepCosts

PROFILE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Batch sizes the step costs are measured at (up to the first one at least the batch size asked for)."""

PROFILE_CONTEXT = 256
"""Cache length (tokens per row) over which steps are timed: a prompt plus part of an answer."""

STEP_COSTS_ENV = "HF_SPECFORMER_CACHE"
"""Environment variable for the folder where measured step costs are kept (default ~/.cache/hf_specformer)."""


@dataclass
class StepCostModel:
    """t(B, w), seconds of one verification step of w drafts per row (w + 1 inputs; w = 0 is a plain step), and
    t_d(B), seconds of drafting for B rows, measured at `batch_sizes` and interpolated linearly in B (extrapolated
    from the last two sizes beyond the largest).

    Attributes:
        batch_sizes: measured batch sizes, increasing.
        step_seconds: `[len(batch_sizes)][max_width + 1]` t(B, w).
        draft_seconds: `[len(batch_sizes)]` t_d(B).
        plain_seconds: `[len(batch_sizes)]` t_plain(B), a plain decoding step (one input per row, with the CPU
            speed-ups and no hidden states, as `_plain_decode` runs it); None: taken as t(B, 0).
        description: what was measured (model, dtype, device, threads), for people reading the cache file.
    """

    batch_sizes: list[int]
    step_seconds: list[list[float]]
    draft_seconds: list[float]
    plain_seconds: list[float] | None = None
    description: dict = field(default_factory=dict)

    @property
    def max_width(self) -> int:
        return len(self.step_seconds[0]) - 1

    def covers(self, batch_size: int, max_width: int) -> bool:
        """Whether `batch_size` lies within the measured sizes and every width up to `max_width` was measured."""
        return self.batch_sizes[0] <= batch_size <= self.batch_sizes[-1] and max_width <= self.max_width

    def _interpolate(self, values: list[float], batch_size: int) -> float:
        sizes = self.batch_sizes
        if len(sizes) == 1:
            return values[0] * batch_size / sizes[0]
        upper = next((i for i, size in enumerate(sizes) if size >= batch_size), len(sizes) - 1)
        upper = max(upper, 1)
        low, high = sizes[upper - 1], sizes[upper]
        weight = (batch_size - low) / (high - low)
        return max(values[upper - 1] + weight * (values[upper] - values[upper - 1]), 1e-9)

    def step(self, batch_size: int, width: int) -> float:
        """t(B, w) in seconds."""
        if not 0 <= width <= self.max_width:
            raise ValueError(f"width {width} outside the measured 0..{self.max_width}.")
        return self._interpolate([row[width] for row in self.step_seconds], batch_size)

    def draft(self, batch_size: int) -> float:
        """t_d(B) in seconds."""
        return self._interpolate(self.draft_seconds, batch_size)

    def plain(self, batch_size: int) -> float:
        """t_plain(B) in seconds."""
        if self.plain_seconds is None:
            return self.step(batch_size, 0)
        return self._interpolate(self.plain_seconds, batch_size)

    def packed(self, batch_size: int, num_inputs: float) -> float:
        """Seconds of a packed step feeding `num_inputs` inputs in all (B..B (w + 1)): t(B, w) at the fractional
        width num_inputs / B - 1, interpolated linearly between the measured widths, which are made non-decreasing
        first (a wider step computes a superset of a narrower one; a measurement that says otherwise is noise)."""
        width = min(max(num_inputs / batch_size - 1, 0.0), self.max_width)
        low = min(int(width), self.max_width - 1)
        below = max(self.step(batch_size, w) for w in range(low + 1))
        above = max(below, self.step(batch_size, low + 1))
        return below + (width - low) * (above - below)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the model as JSON, atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
            json.dump(asdict(self), handle, indent=1)
        os.replace(handle.name, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "StepCostModel":
        """Reads a model written by `save`; ValueError for a file that is not one."""
        try:
            data = json.loads(Path(path).read_text())
            model = cls(**data)
            model.step(1, 0)
        except (OSError, TypeError, ValueError, KeyError, IndexError) as error:
            raise ValueError(f"{path} is not a step-cost file written by StepCostModel.save: {error}") from error
        return model

    def scaled(self, factor: float, plain_factor: float | None = None) -> "StepCostModel":
        """Every cost times `factor`, the plain step's times `plain_factor` (default: the same); for measuring how
        the scheduler copes with a wrong profile."""
        plain = self.plain_seconds or [row[0] for row in self.step_seconds]
        return StepCostModel(
            list(self.batch_sizes), [[seconds * factor for seconds in row] for row in self.step_seconds],
            [seconds * factor for seconds in self.draft_seconds],
            [seconds * (factor if plain_factor is None else plain_factor) for seconds in plain],
            {**self.description, "scaled": [factor, plain_factor]},
        )

    @classmethod
    def learnt(cls, costs: OnlineStepCosts, batch_sizes: list[int], max_width: int, description: dict):
        """Costs learnt from timed steps (`OnlineStepCosts.learnt`) as a model over `batch_sizes` and widths
        0..max_width, for the cache."""
        steps = [[costs.plain(b)] + [costs.verify(b, b * (w + 1)) for w in range(1, max_width + 1)]
                 for b in batch_sizes]
        return cls(list(batch_sizes), steps, [costs.draft(b) for b in batch_sizes],
                   [costs.plain(b) for b in batch_sizes], {**description, "learnt": "from timed decoding steps"})

    def merged_into(self, older: "StepCostModel | None") -> "StepCostModel":
        """This model's batch sizes, with `older`'s other sizes kept (when it measured the same widths)."""
        if older is None or older.max_width != self.max_width or older.plain_seconds is None:
            return self
        rows = {b: (steps, draft, plain) for b, steps, draft, plain in
                zip(older.batch_sizes, older.step_seconds, older.draft_seconds, older.plain_seconds)}
        rows.update(zip(self.batch_sizes, zip(self.step_seconds, self.draft_seconds, self.plain_seconds)))
        sizes = sorted(rows)
        return StepCostModel(sizes, [rows[b][0] for b in sizes], [rows[b][1] for b in sizes],
                             [rows[b][2] for b in sizes], self.description)

    @classmethod
    def from_value(cls, value: "StepCostModel | dict | str | os.PathLike") -> "StepCostModel":
        """A `StepCostModel`, its `asdict` form, or the path of a saved one."""
        if isinstance(value, StepCostModel):
            return value
        if isinstance(value, dict):
            return cls(**value)
        return cls.load(value)


def profile_step_costs(
    step: Callable[[int, int], None],
    draft: Callable[[int], None],
    batch_sizes: list[int],
    max_width: int,
    synchronize: Callable[[], None] = lambda: None,
    repeats: int = 3,
    description: dict | None = None,
    plain: Callable[[int], None] | None = None,
) -> StepCostModel:
    """Times `step(B, w)` for w = 0..max_width, `draft(B)` and `plain(B)` at each batch size; medians of `repeats`
    rounds, all of them alternating within a round so drift on a shared machine hits them alike. One untimed round
    warms up."""
    work = {w: (lambda b, w=w: step(b, w)) for w in range(max_width + 1)}
    work["draft"] = draft
    if plain is not None:
        work["plain"] = plain
    medians = {key: [] for key in work}
    for batch_size in batch_sizes:
        times = {key: [] for key in work}
        for round_index in range(repeats + 1):
            for key, fn in work.items():
                synchronize()
                start = time.perf_counter()
                fn(batch_size)
                synchronize()
                if round_index:
                    times[key].append(time.perf_counter() - start)
        for key in work:
            medians[key].append(statistics.median(times[key]))
    step_seconds = [list(row) for row in zip(*(medians[w] for w in range(max_width + 1)))]
    return StepCostModel(list(batch_sizes), step_seconds, medians["draft"], medians.get("plain"), description or {})


def profile_batch_sizes(batch_size: int) -> list[int]:
    """`PROFILE_BATCH_SIZES` up to the first one at least `batch_size` (or twice the largest beyond it)."""
    sizes = [size for size in PROFILE_BATCH_SIZES if size < batch_size]
    top = next((size for size in PROFILE_BATCH_SIZES if size >= batch_size), None)
    return sizes + [top or max(batch_size, 2 * PROFILE_BATCH_SIZES[-1])]


def step_costs_path(description: dict, folder: str | os.PathLike | None = None) -> Path:
    """Where the step costs of `description` are cached: `<folder>/step_costs/<hash>.json`."""
    folder = folder or os.environ.get(STEP_COSTS_ENV) or Path.home() / ".cache" / "hf_specformer"
    digest = hashlib.sha1(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
    return Path(folder) / "step_costs" / f"{digest}.json"


def cached_step_costs(
    description: dict, batch_size: int, max_width: int,
    measure: Callable[[list[int], int], StepCostModel] | None = None,
) -> StepCostModel | None:
    """The cached model of `description` if it covers (batch_size, max_width); else `measure(batch_sizes, width)`
    and cache the result, or None without `measure`. An unreadable cache file is measured anew and replaced."""
    path = step_costs_path(description)
    if path.exists():
        try:
            cached = StepCostModel.load(path)
            if cached.covers(batch_size, max_width):
                return cached
        except ValueError:
            pass
    if measure is None:
        return None
    costs = measure(profile_batch_sizes(batch_size), max_width)
    costs.save(path)
    return costs
