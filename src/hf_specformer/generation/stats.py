"""Speculation statistics of one `generate` call.

Conventions (see `verification.py` for the terms): a *row-step* is one active row in one verification forward.
`tokens_per_step` (kappa in the SpecFormer paper) is committed tokens per row-step and *counts the correction/bonus
token*, so plain decoding scores 1.0 and k all-accepted drafts score k + 1. It is measured before EOS or length
truncation, so it reflects the drafter, not where the text happens to end. The prefill forward is not a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SpecStats:
    """Counters filled by the engine; all per-row counts are summed over rows and steps.

    Attributes:
        num_draft_tokens: k, drafts proposed per row and step.
        steps: verification forwards of the target.
        row_steps: sum over steps of the rows still generating (finished rows kept as padding excluded).
        drafted: drafts verified (1..k per row-step, see `scheduling.py`).
        accepted: drafts accepted.
        accepted_at: `[k]` how often drafted position j (0-based) was accepted.
        tokens_per_row_step: `[B0]` per original row, committed tokens per step (kappa of that row).
        looked_up: drafts proposed by prompt lookup (`PromptLookupProposer`) rather than the drafter.
        width_counts: `[k + 1]` how many steps verified at most w drafts per row (w = 0: a plain decoding step).
        predicted_accepted: the scheduler's expected accepted drafts, summed over the drafts it verified (with
            `accepted` it gives predicted vs realised acceptance; 0 for schedules that estimate nothing).
        drafting_steps: steps whose drafts came from running the drafter (the rest skipped its slot stage).
        padding: inputs fed after a row's verified drafts to fill the step's rectangle (rows verifying fewer drafts
            than the widest); with packed verification the linear layers skip them (`linears.py`).
        plain_decoding: the goodput scheduler predicted that no width pays at this batch size, so the call ran
            plain decoding (every step width 0, no drafter).
        seconds_by_width: `[k + 1]` seconds the loop spent in steps of width w (measured, drafting included).
        predicted_seconds_by_width: `[k + 1]` what the step-cost profile predicted for the same steps (0 without
            one), so that a gap between the loop and the profile stays visible.
        handoffs: times the goodput scheduler's guard handed the call over to plain steps (`feedback.py`).
        host_reads: device-to-host reads the loop made (`host.py`: at most two per step, plus one on a step where
            rows finish when they are reported as they do, `finishing.py`).
    """

    num_draft_tokens: int
    steps: int = 0
    row_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)
    looked_up: int = 0
    width_counts: list[int] = field(default_factory=list)
    predicted_accepted: float = 0.0
    drafting_steps: int = 0
    plain_decoding: bool = False
    padding: int = 0
    seconds_by_width: list[float] = field(default_factory=list)
    predicted_seconds_by_width: list[float] = field(default_factory=list)
    handoffs: int = 0
    host_reads: int = 0
    _row_steps: torch.Tensor | None = None
    _row_accepted: torch.Tensor | None = None
    _totals: torch.Tensor | None = None  # on the device: drafted, accepted, predicted, looked up, accepted_at,
    # widths, padding

    def __post_init__(self):
        self.accepted_at = [0] * self.num_draft_tokens
        self.width_counts = [0] * (self.num_draft_tokens + 1)
        self.seconds_by_width = [0.0] * (self.num_draft_tokens + 1)
        self.predicted_seconds_by_width = [0.0] * (self.num_draft_tokens + 1)

    def _start(self, batch_size: int, device: torch.device) -> None:
        if self._totals is None:
            self._row_steps = torch.zeros(batch_size, dtype=torch.long, device=device)
            self._row_accepted = torch.zeros(batch_size, dtype=torch.long, device=device)
            self._totals = torch.zeros(4 + 2 * self.num_draft_tokens + 2, dtype=torch.float64, device=device)

    def record(
        self, row_ids: torch.LongTensor, num_accepted: torch.LongTensor, batch_size: int,
        num_drafts: torch.LongTensor, predicted: torch.Tensor | None = None, live: torch.BoolTensor | None = None,
    ) -> None:
        """One verification step: active row `row_ids[b]` verified `num_drafts[b]` drafts and accepted
        `num_accepted[b]` of them (the step's width is the largest); `predicted` `[B, k]` is the estimated chance
        that drafts 1..j are all accepted (None: not estimated); `live` `[B]` marks the rows still generating (None:
        all; finished rows kept as padding verify nothing and are not counted). Counts stay on the device until
        `finish` (no host synchronisation per step)."""
        self._start(batch_size, num_accepted.device)
        k = self.num_draft_tokens
        self.steps += 1
        step = torch.zeros_like(self._totals)
        step[0], step[1] = num_drafts.sum(), num_accepted.sum()
        if predicted is not None:
            verified = torch.arange(predicted.shape[1], device=predicted.device)[None, :] < num_drafts[:, None]
            step[2] = (predicted * verified).sum()
        at_least = torch.arange(1, k + 1, device=num_accepted.device)[None, :] <= num_accepted[:, None]  # [B, k]
        step[4 : 4 + k] = at_least.sum(0)
        step[4 + k : -1] = torch.arange(k + 1, device=num_drafts.device) == num_drafts.max()  # one-hot width, no sync
        step[-1] = num_drafts.max() * num_drafts.numel() - num_drafts.sum()
        self._totals += step
        self._row_steps.index_add_(0, row_ids, torch.ones_like(row_ids) if live is None else live.long())
        self._row_accepted.index_add_(0, row_ids, num_accepted)

    def row_counts(self, rows: torch.LongTensor) -> tuple[torch.LongTensor, torch.LongTensor]:
        """`[n]` steps and accepted drafts so far of the original rows `rows` (`[n]`), on the device."""
        if self._row_steps is None:
            return torch.zeros_like(rows), torch.zeros_like(rows)
        return self._row_steps[rows], self._row_accepted[rows]

    def record_lookups(self, found: torch.BoolTensor, batch_size: int) -> None:
        """Drafts that prompt lookup proposed this step (`found` `[B, k]`), counted on the device."""
        self._start(batch_size, found.device)
        self._totals[3] += found.sum()

    def record_seconds(self, steps: list[tuple[tuple, list[float]]], profile=None) -> None:
        """Timed steps (`StepClock.read`, labelled as `GoodputSchedule.observe` reads them): their seconds by width,
        and beside them what `profile` (a `StepCostModel`, or None) predicted."""
        for (_, batch_size, width, counts, _, drafting), seconds in steps:
            self.seconds_by_width[width] += sum(seconds)
            if profile is not None:
                drafts = int(counts[0])
                step = profile.plain(batch_size) if width == 0 else profile.packed(batch_size, batch_size + drafts)
                self.predicted_seconds_by_width[width] += step + (profile.draft(batch_size) if drafting else 0.0)

    def finish(self) -> None:
        """Copies the device counts into the attributes (one host synchronisation per call)."""
        if self._totals is None:
            return
        k = self.num_draft_tokens
        totals = self._totals.cpu()
        self.row_steps = int(self._row_steps.sum())
        self.drafted, self.accepted, self.looked_up = int(totals[0]), int(totals[1]), int(totals[3])
        self.predicted_accepted = float(totals[2])
        self.accepted_at = [int(count) for count in totals[4 : 4 + k]]
        self.width_counts = [int(count) for count in totals[4 + k : -1]]
        self.padding = int(totals[-1])

    @property
    def tokens_per_step(self) -> float:
        """kappa: mean committed tokens per row-step, bonus/correction token included."""
        return (self.accepted + self.row_steps) / max(self.row_steps, 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens."""
        return self.accepted / max(self.drafted, 1)

    @property
    def drafts_per_step(self) -> float:
        """Drafts verified per row-step (k without a confidence threshold)."""
        return self.drafted / max(self.row_steps, 1)

    @property
    def predicted_acceptance_rate(self) -> float:
        """The scheduler's expected accepted drafts / drafted tokens (compare with `acceptance_rate`)."""
        return self.predicted_accepted / max(self.drafted, 1)

    @property
    def mean_width(self) -> float:
        """Mean over steps of the widest row's verified drafts."""
        return sum(w * n for w, n in enumerate(self.width_counts)) / max(self.steps, 1)

    @property
    def seconds_per_step_by_width(self) -> list[float]:
        """Mean measured seconds of a step of width w (0 where none ran)."""
        return [seconds / max(count, 1) for seconds, count in zip(self.seconds_by_width, self.width_counts)]

    @property
    def predicted_seconds_per_step_by_width(self) -> list[float]:
        """The profile's mean prediction for the same steps (0 without a profile)."""
        return [seconds / max(count, 1) for seconds, count in zip(self.predicted_seconds_by_width, self.width_counts)]

    @property
    def acceptance_by_position(self) -> list[float]:
        """Share of row-steps whose drafted position j was accepted (needs all earlier ones accepted too)."""
        return [count / max(self.row_steps, 1) for count in self.accepted_at]

    @property
    def tokens_per_row_step(self) -> list[float]:
        """Per original row: committed tokens per step."""
        if self._row_steps is None:
            return []
        return ((self._row_accepted + self._row_steps) / self._row_steps.clamp(min=1)).cpu().tolist()

    def to_dict(self) -> dict:
        """Plain numbers, for JSON reports."""
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "steps": self.steps,
            "row_steps": self.row_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tokens_per_step": self.tokens_per_step,
            "acceptance_rate": self.acceptance_rate,
            "drafts_per_step": self.drafts_per_step,
            "acceptance_by_position": self.acceptance_by_position,
            "tokens_per_row_step": self.tokens_per_row_step,
            "looked_up": self.looked_up,
            "width_counts": self.width_counts,
            "mean_width": self.mean_width,
            "predicted_acceptance_rate": self.predicted_acceptance_rate,
            "drafting_steps": self.drafting_steps,
            "plain_decoding": self.plain_decoding,
            "padding": self.padding,
            "seconds_per_step_by_width": self.seconds_per_step_by_width,
            "predicted_seconds_per_step_by_width": self.predicted_seconds_per_step_by_width,
            "handoffs": self.handoffs,
            "host_reads": self.host_reads,
        }
