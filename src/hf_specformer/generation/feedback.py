"""Step costs learnt from the call's own steps, and the rule that hands a losing call over to plain decoding steps.

A start-up profile cannot promise "never slower than plain `generate`": on the CPU testbed the same step cost 1.3 to
1.9x in the loop what a fresh machine's profile said, and a cost file measured elsewhere may be off by any factor. So
the engine times every step it runs (`StepClock`: the wall clock on the CPU, CUDA events read a few steps late on a
GPU, never a blocking synchronisation) and `OnlineStepCosts` keeps three costs from those timings:

- a plain step (one input per row, nothing drafted): t_plain(B);
- a verification step feeding T inputs in all (B rows, T > B): t_verify(B, T);
- drafting for B rows (the drafter's slot stage, and its context stage over the steps it deferred): t_draft(B).

Each is the profile's value (`costs.StepCostModel`, where one is cached) times a running ratio of measured to
predicted seconds, or, with no profile, a line a + b x fitted to the timings: x = B for plain steps and drafting; for
verification, the seconds beyond a plain step of the same rows against x = T - B, the inputs beyond one per row (so
one timed step already prices every width, and a narrow step is never taken for free). A call without a profile
writes what it learnt as one (`StepCostModel.learnt`), so the next call can decide before it starts. A step that
verifies nothing is a plain step (one input per row, with the CPU speed-ups, as `_plain_decode` runs it), since the
drafter defers its work (`drafting.py`), so t_plain is measured in the loop itself: the engine runs a plain step
first, and again whenever `PLAIN_REFRESH_STEPS` steps have passed without one, and every step the schedule gives
width 0 (with proposals or without) is timed as one too. On a shared machine the same plain step drifts in phases
(CPU testbed, B = 1: 65 to 125 ms within one call), and steps of width 0 are the ones that keep t_plain, against
which the guard and the learnt verification cost are measured, in step with that drift.

The guard (`HandOff`), a one-sided CUSUM test. Every step that verified drafts adds its seconds minus (1 +
`HANDOFF_MARGIN`) times what plain steps would have taken for the tokens it committed, t_plain(B) c / L (c: tokens
committed, B rows, L of them still generating), to a deficit floored at minus `HANDOFF_CREDIT` plain steps (gains bank
that much credit, no more); the seconds any step then spent proposing for the next step are added after the test, so
drafting is weighed with the step that reaps it. A step that had proposals but verified none ran a plain step: only the
test runs, since its seconds against t_plain would weigh the machine's drift. When the deficit exceeds its bound h =
max(`HANDOFF_LOSS`, `HANDOFF_SPREAD` sigma) plain steps, the call hands off: nothing is proposed for the next
`HANDOFF_BACKOFF` x 2^(n - 1) steps (the n-th hand-off), which are then plain steps, and the deficit restarts at zero
(a call starts at the floor). sigma is the predicted standard deviation of a verifying step's tokens per live row:
the scheduler's estimates give each row's accepted drafts a variance (`acceptance.accepted_variance`), the guard
keeps a running mean of the step's variance over L^2, and sigma is its root. Bound: the floor only forgets gains, so
each spell of speculation loses at most h plain steps plus one step's excess (its proposing included), net of what it
gained, before it is stopped (the first spell `HANDOFF_CREDIT` more), and the back-off doubles, so a call of N steps
in which speculation never gains loses at most HANDOFF_CREDIT + (h + one step's excess) x (1 + log2(N /
HANDOFF_BACKOFF)) plain steps' worth of time.

Why the credit: acceptance comes in streaks. At B = 1 on MT-bench (SmolLM2, k = 3) half the drafting steps accept
nothing and each costs about a quarter of a plain step more than it returns, so with the deficit floored at zero
five such steps in a row, which most 128-token calls contain, handed a winning call off for 32 plain steps (bench:
calls with 0 hand-offs ran 2.13-2.15x, with 1 to 8 hand-offs 1.44-1.97x). With two plain steps of credit a hand-off
needs a losing run worth three plain steps. A call starts with the credit: without it, streaks before the first gains
handed off 4 of 40 calls (B = 1, MT-bench), each of which a fixed k = 3 ran 10-35% faster, and one of them ran 1.71 s
where it ran 1.32 s with the credit (README, Results). What the credit and the wider bound cost is bounded above:
where every draft was wrong and the table confident, B = 1 calls ran 0.884x plain `generate` with the same CPU
products (0.933x before them), and 1.42x plain `generate`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

RATIO_DECAY = 0.7
"""Weight of the past in the running ratio of measured to profiled seconds."""

FIT_DECAY = 0.9
"""Weight of the past in the least-squares line of a cost without a profile."""

PLAIN_REFRESH_STEPS = 32
"""Steps after which the engine runs a plain step again to re-measure t_plain."""

HANDOFF_LOSS = 1.0
"""Plain steps' worth of seconds speculation may lose (the guard's deficit) before the call hands off."""

HANDOFF_CREDIT = 2.0
"""Plain steps' worth of seconds that gains bank against later losses (the deficit's floor, negated)."""

HANDOFF_MARGIN = 0.02
"""Share of a plain step's time a step must beat to count as keeping up (absorbs the noise of timing one step)."""

HANDOFF_BACKOFF = 32
"""Plain steps after the first hand-off before speculation is tried again (doubled after each further one)."""

HANDOFF_SPREAD = 3.0
"""The hand-off's bound in standard deviations of a step's tokens per row, where that exceeds `HANDOFF_LOSS` plain
steps: the guard waits for a deficit of max(`HANDOFF_LOSS`, `HANDOFF_SPREAD` sigma) plain steps (module docstring)."""

SPREAD_DECAY = 0.9
"""Weight of the past in the guard's running mean of the predicted variance of a step's tokens per row."""


class StepClock:
    """Times the decoding loop's steps without blocking. `mark()` splits a step into segments; `lap(label)` ends the
    step begun at the last `lap` or `restart`. `read()` returns `(label, [seconds of each segment])` for the steps
    whose end has passed: all of them on the CPU; on CUDA those whose end event has completed. Labels hold host
    values only (the engine's counts come from its one read per step, `host.py`)."""

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
        """Forgets the time since the last lap (work that belongs to no step)."""
        self.marks = [self._now()]

    def mark(self) -> None:
        self.marks.append(self._now())

    def lap(self, label: tuple) -> None:
        self.marks.append(self._now())
        self.pending.append((label, self.marks))
        self.marks = [self.marks[-1]]

    def read(self) -> list[tuple[tuple, list[float]]]:
        done = []
        while self.pending and (not self.cuda or self.pending[0][1][-1].query()):
            label, marks = self.pending.popleft()
            pairs = zip(marks, marks[1:])
            done.append((label, [start.elapsed_time(end) / 1000 if self.cuda else end - start for start, end in pairs]))
        return done


class _Cost:
    """One cost: `prior(key)` times the running ratio measured / prior (the first timing sets it: a profile gives the
    shape across batch sizes and widths, this machine now the scale), or without a prior a line a + b x fitted by
    decayed least squares. While a single x has been seen: a line through the origin (`proportional`), else a
    constant (rows below the ridge point cost about the same; for more rows the guess underrates the cost)."""

    def __init__(self, prior: Callable | None, proportional: bool = False):
        self.prior = prior
        self.proportional = proportional
        self.ratio = 1.0
        self.sums = [0.0] * 5  # decayed n, sum x, sum x^2, sum y, sum x y
        self.observed = 0

    @property
    def known(self) -> bool:
        return self.prior is not None or self.observed > 0

    def observe(self, key, x: float, seconds: float) -> None:
        self.observed += 1
        if self.prior is not None:
            ratio = seconds / self.prior(key)
            self.ratio = ratio if self.observed == 1 else RATIO_DECAY * self.ratio + (1 - RATIO_DECAY) * ratio
            return
        for i, value in enumerate((1.0, x, x * x, seconds, x * seconds)):
            self.sums[i] = FIT_DECAY * self.sums[i] + value

    def __call__(self, key, x: float) -> float:
        if self.prior is not None:
            return self.prior(key) * self.ratio
        n, sx, sxx, sy, sxy = self.sums
        mean_x, mean_y = sx / n, sy / n
        variance = sxx / n - mean_x**2
        if variance <= 1e-6 * mean_x**2:
            return mean_y * x / mean_x if self.proportional else mean_y
        slope = max((sxy / n - mean_x * mean_y) / variance, 0.0)
        intercept = mean_y - slope * mean_x
        if intercept < 0:
            return sxy / sxx * x
        return intercept + slope * x


class OnlineStepCosts:
    """t_plain(B), t_verify(B, T) and t_draft(B) in seconds, from a profile corrected by the call's timings or from
    the timings alone (see the module docstring).

    Args:
        profile: a `StepCostModel` measured on this machine, or None.
    """

    def __init__(self, profile=None):
        self.profile = profile
        has = profile is not None
        self._plain = _Cost(profile.plain if has else None)
        self._verify = _Cost((lambda key: profile.packed(*key)) if has else None, proportional=True)
        self._draft = _Cost(profile.draft if has else None)
        self.plain_batch_sizes: set[int] = set()

    @property
    def known(self) -> bool:
        """Whether every cost has a value (a profile, or at least one timing each)."""
        return self._plain.known and self._verify.known and self._draft.known

    @property
    def plain_known(self) -> bool:
        return self._plain.known

    @property
    def verify_known(self) -> bool:
        return self._verify.known

    def plain(self, batch_size: int) -> float:
        return self._plain(batch_size, batch_size)

    def verify(self, batch_size: int, num_inputs: float) -> float:
        """A step feeding `num_inputs` > B inputs in all; never less than a plain step."""
        if self.profile is None:
            extra = self._verify((batch_size, num_inputs), num_inputs - batch_size)
            return self.plain(batch_size) + max(extra, 0.0)
        return max(self._verify((batch_size, num_inputs), num_inputs), self.plain(batch_size))

    def draft(self, batch_size: int) -> float:
        return self._draft(batch_size, batch_size)

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        self.plain_batch_sizes.add(batch_size)
        self._plain.observe(batch_size, batch_size, seconds)

    def observe_verify(self, batch_size: int, num_inputs: int, seconds: float) -> None:
        if self.profile is None:
            if self._plain.known:
                self._verify.observe(None, num_inputs - batch_size, seconds - self.plain(batch_size))
            return
        self._verify.observe((batch_size, num_inputs), num_inputs, seconds)

    @property
    def learnt(self) -> bool:
        """Whether every cost was learnt from timings alone (no profile); they hold for the batch sizes whose plain
        steps were timed (`plain_batch_sizes`)."""
        return self.profile is None and self._verify.observed > 0 and self._draft.observed > 0 \
            and bool(self.plain_batch_sizes)

    def observe_draft(self, batch_size: int, seconds: float) -> None:
        self._draft.observe(batch_size, batch_size, seconds)


class HandOff:
    """The guard of the module docstring: `observe` each step that proposed or verified; `active` while the call runs
    plain steps because speculation fell behind."""

    def __init__(self, costs: OnlineStepCosts, loss: float | None = None, backoff: int | None = None):
        self.costs = costs
        self.loss = HANDOFF_LOSS if loss is None else loss
        self.backoff = HANDOFF_BACKOFF if backoff is None else backoff
        self.deficit: float | None = None  # seconds behind plain decoding, floored at -HANDOFF_CREDIT plain steps;
        # None until t_plain is known, then the credit (a call starts with it)
        self.variance: float | None = None  # running predicted variance of a step's tokens per row (a token per row
        # is a plain step's worth of time, so sigma reads in plain steps)
        self.handoffs = 0
        self.plain_steps_left = 0

    @property
    def active(self) -> bool:
        return self.plain_steps_left > 0

    def plain_step(self) -> None:
        """Counts down a plain step taken while handed off."""
        self.plain_steps_left = max(self.plain_steps_left - 1, 0)

    @property
    def bound(self) -> float:
        """The deficit, in plain steps, beyond which the call hands off: `HANDOFF_LOSS`, or `HANDOFF_SPREAD` times
        the predicted standard deviation of a step's tokens per row where that is larger."""
        return max(self.loss, HANDOFF_SPREAD * (self.variance or 0.0) ** 0.5)

    def observe(self, batch_size: int, num_live: int, committed: int, seconds: float,
                proposing_seconds: float = 0.0, verified: bool = True, predicted_variance: float = 0.0) -> None:
        """A step of `batch_size` rows, `num_live` of them still generating (the rest finished, kept as padding),
        that committed `committed` tokens in `seconds`, then proposed for the next step in `proposing_seconds`: an
        outlay weighed with the next step, which reaps it.

        A step that verified nothing (`verified=False`: the schedule gave every row width 0) ran a plain step's
        forward, so only the outlay before it is tested and its own seconds are not weighed: against t_plain, they
        would measure the machine's drift since t_plain was learnt, not speculation. On the CPU testbed (B = 1,
        MT-bench) the shared machine's plain steps drifted between 65 and 125 ms within a call, and runs of such
        steps at 105-110 ms against a t_plain of 81 ms made hand-offs of 32 and 128 plain steps on their own."""
        if not self.costs.plain_known or not num_live or self.active:  # active: proposed before the hand-off
            return
        plain = self.costs.plain(batch_size)
        if self.deficit is None:
            self.deficit = -HANDOFF_CREDIT * plain
        if verified:
            self.deficit = max(self.deficit + seconds - (1 + HANDOFF_MARGIN) * plain * committed / num_live,
                               -HANDOFF_CREDIT * plain)
            per_row = predicted_variance / num_live**2
            self.variance = per_row if self.variance is None else \
                SPREAD_DECAY * self.variance + (1 - SPREAD_DECAY) * per_row
        if self.deficit > self.bound * plain:
            self.plain_steps_left = self.backoff * 2**self.handoffs
            self.handoffs += 1
            self.deficit = 0.0
        else:
            self.deficit += proposing_seconds
