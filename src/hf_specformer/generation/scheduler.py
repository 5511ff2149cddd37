"""How many drafts each row verifies: `wants` (what to propose), `choose` (from the scores), `observe` (timed steps).

`FixedSchedule` verifies all k (or those above a confidence threshold). `GoodputSchedule` (Speculative Verification,
section 5) picks the width w maximising (L + sum_b sum_{j <= w} q_{b,j}) / t(B, w) on learnt `StepCosts`, and its
guard (`HandOff`) hands a call that falls behind plain decoding over to plain steps. Reasoning: docs/scheduler.md.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

PROBE_INTERVAL = 8
"""Steps without drafting after which the scheduler drafts once, so that its estimate of what drafting brings follows
the text."""

MAX_PROBE_BACKOFF = 8
"""The probe interval doubles after each probe that finds drafting still does not pay, up to this factor."""

DRAFTING_MARGIN = 0.05
"""Share by which drafting's expected rate must beat plain decoding's: near break-even the learnt costs are noise."""

EXPECTED_DECAY = 0.8
"""Weight of the past in the running mean E_w of expected accepted drafts per row at width w."""

COST_DECAY = 0.7
"""Weight of the past in each learnt cost: a shared machine's step times drift in phases, so recent steps count most."""

INPUT_COST_DECAY = 0.95
"""Weight of the past in the fit of t_input (about 20 steps): a small slope between noisy step times, so that one
slow step does not make every draft look too dear to verify."""

MIN_WIDTH_VARIANCE = 0.05
"""Variance of the widths (in drafts per row, squared) below which the recent steps cannot tell t_input."""

PLAIN_REFRESH_STEPS = 32
"""Steps after which a plain step is run again, to re-measure t_plain against the machine's drift."""

HANDOFF_LOSS = 1.0
"""Plain steps' worth of seconds speculation may lose before the guard hands the call over to plain steps."""

HANDOFF_CREDIT = 2.0
"""Plain steps' worth of seconds that gains bank against later losses: acceptance comes in streaks."""

HANDOFF_MARGIN = 0.02
"""Share of a plain step's time a step must beat to count as keeping up (the noise of timing one step)."""

HANDOFF_BACKOFF = 32
"""Plain steps after the first hand-off before speculation is tried again (doubled after each further one)."""

MAX_HANDOFF_DOUBLINGS = 2
"""Doublings of the back-off at most: a call that keeps running (a server's) tries again every 128 plain steps, so
speculation that never pays costs it at most `HANDOFF_LOSS` plain steps in 128."""


class StepClock:
    """Times steps without blocking (CUDA events read once complete on a GPU): `lap` ends a segment, `end(label)` the
    step; `read()` -> `(label, [seconds per segment])` of the steps done."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: deque = deque()
        self.marks = [self._now()]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def restart(self) -> None:
        self.marks = [self._now()]

    def lap(self) -> None:
        self.marks.append(self._now())

    def end(self, label) -> None:
        self.marks.append(self._now())
        self.pending.append((label, self.marks))
        self.marks = [self.marks[-1]]

    def read(self) -> list:
        done = []
        while self.pending and (not self.cuda or self.pending[0][1][-1].query()):
            label, marks = self.pending.popleft()
            pairs = zip(marks, marks[1:])
            done.append((label, [a.elapsed_time(b) / 1000 if self.cuda else b - a for a, b in pairs]))
        return done


@dataclass
class TimedStep:
    """What the goodput scheduler learns from one step (host values)."""

    batch_size: int  # B, rows fed (finished rows kept as padding included)
    width: int  # w, the most drafts a row verified (0: a plain step)
    num_live: int  # L, rows that were still generating
    accepted: int  # drafts accepted in all
    proposed: bool  # the step had proposals (False: a plain step by the schedule's word)
    proposing: bool  # anything was proposed after it, for the next step
    drafted: bool  # the drafter's network ran after it


@dataclass
class StepCosts:
    """Seconds of a step per batch size, t(B, w) = t_plain(B) + t_input(B) B w, and t_draft(B), learnt from timed
    steps (the nearest batch size timed, else the priors per row, stands in).

    Args:
        plain: prior t_plain(B) / B (None: unknown until a plain step is timed).
        per_input: prior seconds per input beyond one per row.
        draft: prior t_draft(B) / B.
        learn: learn from the steps, run plain steps to re-measure, and guard the call; False: the priors as given
            (choices then repeat exactly; tests and reproducible runs).
    """

    plain: float | None = None
    per_input: float | None = None
    draft: float | None = None
    learn: bool = True
    learnt: dict = field(default_factory=dict, repr=False)  # ("plain" | "input" | "draft", B) -> seconds
    moments: dict = field(default_factory=dict, repr=False)  # B -> decayed sums of 1, x, x^2, t, x t (x = B w)

    def __post_init__(self):
        if not self.learn and None in (self.plain, self.per_input, self.draft):
            raise ValueError("StepCosts(learn=False) needs plain, per_input and draft.")

    def get(self, kind: str, batch_size: int) -> float | None:
        timed = [size for learnt_kind, size in self.learnt if learnt_kind == kind]
        if timed:
            return max(self.learnt[kind, min(timed, key=lambda size: (abs(size - batch_size), size))], 0.0)
        prior = {"plain": self.plain, "input": self.per_input, "draft": self.draft}[kind]
        return None if prior is None else prior * (1 if kind == "input" else batch_size)

    def step(self, batch_size: int, width: int) -> float:
        return self.get("plain", batch_size) + self.get("input", batch_size) * batch_size * width

    def observe_step(self, batch_size: int, width: int, seconds: float) -> None:
        """A step's verifying seconds at `width`: t_input(B) is their slope over the inputs, fitted with forgetting."""
        if not self.learn:
            return
        sums, inputs = self.moments.setdefault(batch_size, [0.0] * 5), batch_size * width
        for i, value in enumerate((1.0, inputs, inputs * inputs, seconds, inputs * seconds)):
            sums[i] = INPUT_COST_DECAY * sums[i] + value
        mean_x, mean_t = sums[1] / sums[0], sums[3] / sums[0]
        variance = sums[2] / sums[0] - mean_x**2
        if variance > MIN_WIDTH_VARIANCE * batch_size**2:
            self.learnt["input", batch_size] = (sums[4] / sums[0] - mean_x * mean_t) / variance

    def observe(self, kind: str, batch_size: int, seconds: float) -> None:
        if self.learn:
            old = self.learnt.get((kind, batch_size))
            self.learnt[kind, batch_size] = seconds if old is None else COST_DECAY * old + (1 - COST_DECAY) * seconds


class HandOff:
    """The guard, a one-sided CUSUM test: each verifying step adds its seconds minus what plain steps would have taken
    for its tokens to a deficit floored at -`HANDOFF_CREDIT` plain steps; beyond `HANDOFF_LOSS` the call runs
    `HANDOFF_BACKOFF` x 2^min(n - 1, 2) plain steps (the n-th hand-off): a spell of speculation loses a bounded time."""

    def __init__(self):
        self.deficit: float | None = None
        self.handoffs = 0
        self.plain_steps_left = 0

    @property
    def active(self) -> bool:
        return self.plain_steps_left > 0

    def observe(self, plain: float, step: TimedStep, seconds: float, proposing: float) -> None:
        if self.active:
            self.plain_steps_left -= not step.proposed
            return
        if self.deficit is None:
            self.deficit = -HANDOFF_CREDIT * plain
        if step.width and step.num_live:
            committed = (step.num_live + step.accepted) / step.num_live
            self.deficit = max(self.deficit + seconds - (1 + HANDOFF_MARGIN) * plain * committed,
                               -HANDOFF_CREDIT * plain)
        if self.deficit > HANDOFF_LOSS * plain:
            self.plain_steps_left = HANDOFF_BACKOFF * 2 ** min(self.handoffs, MAX_HANDOFF_DOUBLINGS)
            self.handoffs += 1
            self.deficit = 0.0
        elif step.proposing:
            self.deficit += proposing


def longest_confident_prefix(cumulative: torch.Tensor, threshold: float) -> torch.LongTensor:
    """`[B, k]` cumulative confidence -> `[B]` drafts reaching `threshold` (at least 1; 0 without drafts)."""
    return ((cumulative >= threshold).sum(1).clamp(min=1) * (cumulative[:, 0] > 0)).long()


class FixedSchedule:
    """All k drafts (threshold 0), or the longest prefix above a cumulative-confidence threshold."""

    handoffs = 0

    def __init__(self, num_draft_tokens: int, threshold: float = 0.0):
        self.num_draft_tokens, self.threshold = num_draft_tokens, threshold

    @property
    def needs_scores(self) -> bool:
        return self.threshold > 0

    def wants(self, batch_size: int) -> tuple[bool, bool]:
        return True, True

    def choose(self, scores: torch.Tensor, num_rows: int, num_live: int, drafted: bool) -> torch.LongTensor:
        """Cumulative confidence `[B, k]` on the host (the engine verifies all k without a threshold)."""
        return longest_confident_prefix(scores, self.threshold)

    def observe(self, steps: list) -> None:
        """A fixed schedule learns nothing."""


class GoodputSchedule:
    """Speculative Verification's goodput scheduler (see the module docstring) on `costs`.

    Args:
        num_draft_tokens: k, the widest step.
        costs: the step costs (learnt, or fixed with `learn=False`).
        expected_accepted: E_w for w = 0..k from calibration (None: learnt from the first drafted step).
    """

    needs_scores = True

    def __init__(self, num_draft_tokens: int, costs: StepCosts, expected_accepted: list[float] | None = None):
        self.k, self.costs = num_draft_tokens, costs
        self.expected = None if expected_accepted is None else torch.tensor(
            (list(expected_accepted) + [expected_accepted[-1]] * (num_draft_tokens + 1))[: num_draft_tokens + 1],
            dtype=torch.float64)
        self.handoff = HandOff()
        self.steps_without_drafting, self.probe_backoff = 0, 1
        self.steps_since_plain = 0 if not costs.learn else None  # None: a plain step is due
        self.plain_steps_untimed = 0  # plain steps run for their timing, whose timing has not come yet

    @property
    def handoffs(self) -> int:
        return self.handoff.handoffs

    def plain_step_due(self, batch_size: int) -> bool:
        """The next step is plain (nothing proposed): t_plain is unknown or stale, or the call is handed off."""
        if not self.costs.learn:
            return False
        stale = self.costs.get("plain", batch_size) is None or self.steps_since_plain is None or \
            self.steps_since_plain >= PLAIN_REFRESH_STEPS
        return self.handoff.active or (stale and not self.plain_steps_untimed)

    def wants(self, batch_size: int) -> tuple[bool, bool]:
        """(draft, free): whether the drafter should draft for the next step, and whether anything is proposed."""
        if batch_size == 0 or self.plain_step_due(batch_size):
            self.plain_steps_untimed += batch_size > 0 and not self.handoff.active
            return False, False
        if self.expected is None or None in (self.costs.get(kind, batch_size) for kind in ("input", "draft")):
            return True, True
        if self._drafting_pays(batch_size):
            self.steps_without_drafting, self.probe_backoff = 0, 1
            return True, True
        if self.steps_without_drafting >= PROBE_INTERVAL * self.probe_backoff:
            self.steps_without_drafting = 0
            self.probe_backoff = min(2 * self.probe_backoff, MAX_PROBE_BACKOFF) if self.costs.learn else 1
            return True, True
        self.steps_without_drafting += 1
        return False, True

    def _drafting_pays(self, batch_size: int) -> bool:
        """max_w B (1 + E_w) / (t(B, w) + t_draft(B)) > (1 + `DRAFTING_MARGIN`) B / t_plain(B), over w >= 1."""
        seconds = torch.tensor([self.costs.step(batch_size, w) for w in range(1, self.k + 1)], dtype=torch.float64)
        rates = (1 + self.expected[1:]) / (seconds + self.costs.get("draft", batch_size))
        return bool(rates.max() > (1 + DRAFTING_MARGIN) / self.costs.get("plain", batch_size))

    def choose(self, scores: torch.Tensor, num_rows: int, num_live: int, drafted: bool) -> torch.LongTensor:
        """scores `[B, k]` (q_{b,j}) -> drafts each row verifies `[B]`, on the host: up to the best width, those that
        pay for their own input (q_{b,j} >= t_input x rate); one each while t_input is unknown."""
        scores = scores.double()
        if drafted:
            per_row = torch.cat([scores.new_zeros(num_rows, 1), scores.cumsum(1)], dim=1).mean(0)
            self.expected = per_row if self.expected is None else \
                EXPECTED_DECAY * self.expected + (1 - EXPECTED_DECAY) * per_row
        if self.plain_step_due(num_rows):
            return torch.zeros(num_rows, dtype=torch.long)
        if self.costs.get("input", num_rows) is None:
            return (scores[:, :1] > 0).sum(1)
        width, rate = self.best_width(scores, num_rows, num_live)
        floor = self.costs.get("input", num_rows) * rate
        return ((scores[:, :width] > 0) & (scores[:, :width] >= floor)).sum(1)

    def best_width(self, scores: torch.Tensor, num_rows: int, num_live: int) -> tuple[int, float]:
        """The width w = 0..k of the best rate (L + sum_b sum_{j <= w} q_{b,j}) / t(B, w), and that rate."""
        gain = torch.cat([scores.new_zeros(1), scores.sum(0).cumsum(0)])  # [k + 1] accepted drafts at width w
        seconds = torch.tensor([self.costs.step(num_rows, w) for w in range(scores.shape[1] + 1)], dtype=torch.float64)
        rates = (num_live + gain) / seconds.cummax(0).values
        width = int(rates.argmax())
        return width, float(rates[width])

    def observe(self, steps: list) -> None:
        """Timed steps `(TimedStep, [seconds verifying, seconds proposing])` from the `StepClock`."""
        if not self.costs.learn:
            return
        for step, (seconds, proposing) in steps:
            batch = step.batch_size
            self.steps_since_plain = 0 if not step.proposed else (self.steps_since_plain or 0) + 1
            self.plain_steps_untimed = max(self.plain_steps_untimed - (not step.proposed), 0)
            if step.width == 0:
                self.costs.observe("plain", batch, seconds + (0.0 if step.proposing else proposing))
            self.costs.observe_step(batch, step.width, seconds)
            if step.drafted:
                self.costs.observe("draft", batch, proposing)
            if self.costs.get("plain", batch) is not None:
                self.handoff.observe(self.costs.get("plain", batch), step, seconds, proposing)
