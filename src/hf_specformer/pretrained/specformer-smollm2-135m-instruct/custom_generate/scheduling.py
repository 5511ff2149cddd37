"""How many drafts each row verifies per step: a fixed k, a confidence threshold, or the goodput scheduler.

Every verified draft is a row of the target forward, accepted or not. Three schedules:

- `FixedSchedule` (threshold 0): every row verifies all k drafts.
- `FixedSchedule` (threshold t > 0): a row verifies its drafts 1..n, n the last position whose cumulative draft
  probability q_1(d_1) ... q_j(d_j) is at least t (at least one; looked-up drafts count as certain).
- `GoodputSchedule` (Speculative Verification, arXiv 2509.24328, section 5; vLLM's adaptive verification): from the
  estimated chance q_{b,j} that drafts 1..j of row b are all accepted (`acceptance.py`), pick the step that maximises
  expected committed tokens per second under step costs learnt from the call's own timed steps, starting from a
  `StepCostModel` measured on the running machine where one is cached (`feedback.OnlineStepCosts`). Width w = 0 is a
  plain decoding step, and a guard hands a call whose speculation falls behind over to plain steps
  (`feedback.HandOff`), so speculation never costs more than it returns beyond the bound written there.

Choices where the paper is silent or does not fit this engine:
- Expected committed tokens are B + sum_b sum_{j <= w_b} q_{b,j}: the paper's goodput counts accepted drafts only,
  which cannot compare a speculative step with a plain one (every row commits one token either way).
- Packed verification (the default, `linears.py`): a step's linear layers compute only the inputs it verifies, so
  its cost depends on the inputs fed in all, T = B + sum_b n_b. The paper's batch greedy applies as written: the
  (row, position) candidates by decreasing q_{b,j}, and the prefix of them that maximises (B + gain) / t(B, T).
  t(B, T) is t(B, w) at the fractional width T / B - 1, interpolated between the widths measured. The rest of the
  forward (attention, RoPE, norms) still runs over the padded rectangle of B (w + 1) inputs, w the widest row's
  drafts, so a step is priced at T + `RECTANGLE_WEIGHT` (B (w + 1) - T) inputs (`effective_inputs`). For each cap
  w = 0..k the greedy runs over the candidates j <= w, and the best of the k + 1 is taken. The costs are still
  learnt per verified input (`observe`): learnt per priced input, one timed step of a nearly empty rectangle (one
  row's draft widening all of them) made the line so flat that full widths looked cheap, and at B = 8 the next call
  speculated where it had gone plain (README, Results). So the price of the rectangle comes on top of a slope that
  already carries the average rectangle of the steps timed: it errs toward plain steps. The sort is stable, so every
  prefix of candidates is a union of row prefixes, and the choice is the exact optimum over per-row prefixes under
  that cost.
- Padded verification (`packed_verification=False`): every row feeds w + 1 inputs, and the cost depends on (B, w)
  only. The batch greedy then reduces to choosing w: once a row's position j <= w is paid for, verifying it is
  free. So w* = argmax_w (B + sum_b sum_{j<=w} q_{b,j}) / t(B, w), the exact optimum, and each row verifies its
  drafts up to w* (fewer where it has fewer).
- Per call (SGLang's per-batch-size choice, from measurements rather than fixed buckets): the engine's best
  predicted rate with drafts, max_{w >= 1} B (1 + E_w) / (t(B, w) + t_d(B)) from the calibrated expected gains E_w
  (`AcceptanceTable.expected_accepted`), is compared with plain decoding's B / t_plain(B), where t_plain is a
  forward of one token per row with the CPU speed-ups and no hidden states, what the engine's width-0 steps and
  `_plain_decode` both run. Width 0 is left out: an engine whose best step verifies nothing can only differ from
  plain decoding by its own KV cache and by the noise of two close measurements, never by speculation. Unless the
  engine is ahead by `ENGINE_OVERHEAD` (what the step costs do not see: the prefill records the hidden states the
  drafter reads, about 2% of a long padded prefill, and the drafter reads the prompt), `speculation_pays` is False
  and the call runs transformers' plain decoding loop (`_plain_decode`: no drafter, no hidden states, the CPU
  speed-ups on). Without calibration it speculates.
- Drafting itself costs (SpecFormer's slot stage and head, t_d(B)). The drafts of the next step are made before
  their estimates are known, so `should_draft` predicts: it keeps a running mean E_w of expected accepted drafts
  per row at each width, and drafts when max_w B (1 + E_w) / (t(B, w) + t_d(B)) beats B / t_plain(B). Otherwise the
  drafter defers its work (`Proposer.propose(..., draft=False)`); prompt lookup still proposes, at no cost. After
  `PROBE_INTERVAL` steps without drafting it drafts once, so E_w follows the text; with cost feedback the interval
  doubles after each probe that finds drafting still does not pay (up to `MAX_PROBE_BACKOFF`).
- Both predictions (`should_draft`, `speculation_pays`) rate every row verifying w drafts, also for packed steps,
  whose per-row choice does at least as well: they err toward plain steps, the side that cannot lose.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch

from .acceptance import accepted_variance
from .costs import StepCostModel
from .feedback import PLAIN_REFRESH_STEPS, HandOff, OnlineStepCosts

CONFIDENCE_THRESHOLD = 0.0
"""Default threshold on a row's cumulative draft probability for `FixedSchedule` (0: every row verifies all k)."""

PROBE_INTERVAL = 8
"""Steps without drafting after which `GoodputSchedule.should_draft` drafts once to refresh its estimates."""

MAX_PROBE_BACKOFF = 8
"""With cost feedback, the interval between probes doubles after each probe that finds drafting still does not pay,
up to this factor (a call that never gains then loses O(log N) probes, not N / PROBE_INTERVAL)."""

EXPECTED_TOKENS_DECAY = 0.8
"""Weight of the past in the running mean E_w of expected accepted drafts per row."""

ENGINE_OVERHEAD = 0.05
"""Margin by which the engine's predicted rate must beat plain decoding's for a call to speculate."""

RECTANGLE_WEIGHT = 0.5
"""What an input of a packed step's rectangle that verifies nothing (a row's padding after its last verified draft)
costs, as a share of an input that is verified: the linear layers skip it, but the attention, RoPE, the norms, the
activations and the packing's own scatter still run over the whole rectangle `[B, w + 1]`. Measured on the CPU
testbed (SmolLM2 fp32, cache of 300 columns, medians of 8): at B = 16 a rectangle of 4 inputs per row verifying 2
cost 260-304 ms against 227-257 ms for 2 per row (32 unverified inputs: 33-47 ms) and 319-388 ms for all 4 (32 more
verified: 60-85 ms), a weight of 0.55; at B = 8, 184 against 164 and 210 ms, 0.77. 0.5 stays below both, so the
scheduler still weighs a row's long draft at what it at least costs."""


def effective_inputs(batch_size: int, num_inputs: float, width: int) -> float:
    """The inputs a packed step is priced at: the `num_inputs` it verifies plus `RECTANGLE_WEIGHT` times the rest of
    its rectangle of `batch_size` rows by `width` + 1 inputs."""
    return num_inputs + RECTANGLE_WEIGHT * max(batch_size * (width + 1) - num_inputs, 0)


def num_drafts_to_verify(draft_confidence: torch.Tensor, threshold: float) -> torch.LongTensor:
    """draft_confidence `[B, k]` (q_j(d_j), the probability each draft had when it was chosen) -> `[B]` in 1..k: the
    longest prefix whose cumulative probability is at least `threshold`, at least 1."""
    kept = draft_confidence.double().cumprod(dim=1) >= threshold
    return kept.sum(dim=1).clamp(min=1)


class Schedule(Protocol):
    """What the engine asks of a schedule, in the order of a call (the model: transformers' `CandidateGenerator`).

    Everything a schedule reads is on the host: the estimates it chooses from were read once (`host.py`), and the
    timed steps it learns from carry host counts. Its state lives in its attributes (costs, running means, the
    hand-off guard) and is made fresh for every call.
    """

    needs_confidence: bool
    """Whether `choose` reads the drafts' confidence (the engine then computes and reads it)."""

    def speculation_pays(self, batch_size: int) -> bool:
        """Before the call: whether to run the engine at all rather than transformers' plain decoding loop."""

    def plain_step_due(self) -> bool:
        """Before proposing: whether the next step must be plain (nothing proposed, not even free drafts)."""

    def should_draft(self, batch_size: int) -> bool:
        """Before proposing: whether the proposer's network should draft for the next step."""

    def choose(self, scores: torch.Tensor, drafted: bool = True) -> torch.LongTensor:
        """scores `[B, k]` on the host (per-draft confidence, or the cumulative acceptance estimates) -> drafts each
        row verifies `[B]` on the host; `drafted`: the proposer's network made drafts (not free drafts alone)."""

    def stepped(self, proposed: bool) -> None:
        """After choosing: the engine runs a step, with proposals or (False) a plain one."""

    def observe(self, steps: list[tuple[tuple, list[float]]]) -> None:
        """Timed steps as `feedback.StepClock.read` returns them (see `GoodputSchedule.observe`)."""


class FixedSchedule:
    """All k drafts (threshold 0), or the longest prefix of drafts above a cumulative-probability threshold."""

    def __init__(self, num_draft_tokens: int, threshold: float = CONFIDENCE_THRESHOLD):
        self.num_draft_tokens = num_draft_tokens
        self.threshold = threshold

    @property
    def needs_confidence(self) -> bool:
        """Whether `choose` reads the drafts' confidence (only with a threshold)."""
        return self.threshold > 0

    def choose(self, confidence: torch.Tensor, drafted: bool = True) -> torch.LongTensor:
        """confidence `[B, k]` on the host (q_j(d_j); read only with a threshold, else only its shape) -> drafts each
        row verifies `[B]`, on the host."""
        if self.threshold <= 0:
            return torch.full(confidence.shape[:1], confidence.shape[1], dtype=torch.long)
        return num_drafts_to_verify(confidence, self.threshold)

    def should_draft(self, batch_size: int) -> bool:
        return True

    def plain_step_due(self) -> bool:
        return False

    def speculation_pays(self, batch_size: int) -> bool:
        return True

    def stepped(self, proposed: bool) -> None:
        """Fixed schedules keep no count of steps."""

    def observe(self, steps: list) -> None:
        """Fixed schedules learn nothing from step timings."""


class GoodputSchedule:
    """Speculative Verification's goodput scheduler (see the module docstring), on step costs learnt from the call's
    own steps (`feedback.py`).

    Args:
        costs: the step-cost model of this target, dtype, device and drafter (`StepCostModel`), the online costs
            built on one (`OnlineStepCosts`), or None: learnt from the call's steps alone.
        num_draft_tokens: k, the widest step.
        expected_accepted: E_w for w = 0.. from calibration (shorter lists are extended with their last value), or
            None: unknown until the first drafted step.
        probe_interval: steps without drafting after which it drafts once.
        packed: steps are packed (cost by inputs fed, per-(row, draft) choice) rather than padded (one width).
        feedback: learn the costs from timed steps (`observe`), run plain steps to measure them, and hand off when
            speculation falls behind; False: `costs` as given (choices repeat exactly).
    """

    def __init__(
        self, costs: StepCostModel | OnlineStepCosts | None, num_draft_tokens: int,
        expected_accepted: list[float] | None = None, probe_interval: int = PROBE_INTERVAL, packed: bool = True,
        feedback: bool = True,
    ):
        if isinstance(costs, StepCostModel) and costs.max_width < num_draft_tokens:
            raise ValueError(f"The step costs measure widths up to {costs.max_width}, not k = {num_draft_tokens}.")
        self.costs = costs if isinstance(costs, OnlineStepCosts) else OnlineStepCosts(costs)
        self.handoff = HandOff(self.costs)
        self.variances: deque[float] = deque()  # predicted variance of the drafts accepted by chosen steps not yet
        # observed (`acceptance.accepted_variance`), for the guard
        self.num_draft_tokens = num_draft_tokens
        self.probe_interval = probe_interval
        self.packed = packed
        self.expected: torch.Tensor | None = None  # [k + 1] E_w, expected accepted drafts per row at width w
        if expected_accepted is not None:
            padded = list(expected_accepted) + [expected_accepted[-1]] * (num_draft_tokens + 1)
            self.expected = torch.tensor(padded[: num_draft_tokens + 1], dtype=torch.float64)
        self.steps_without_drafting = 0
        self.probe_backoff = 1  # probes come every probe_interval x this steps; doubled while drafting does not pay
        self.feedback = feedback
        self.steps_since_plain: int | None = None if feedback else 0  # None: a plain step is due to measure t_plain

    needs_confidence = False  # it reads the estimates (`cumulative`), which need the probabilities anyway

    def step_seconds(self, batch_size: int) -> torch.Tensor:
        """`[k + 1]` t(B, w) for w = 0..k (w = 0: a plain step), non-decreasing in w."""
        seconds = [self.costs.plain(batch_size)]
        seconds += [self.costs.verify(batch_size, batch_size * (w + 1)) for w in range(1, self.num_draft_tokens + 1)]
        return torch.tensor(seconds, dtype=torch.float64).cummax(0).values

    def packed_step_seconds(self, batch_size: int, num_inputs: torch.Tensor, width: int) -> torch.Tensor:
        """Seconds of packed steps feeding `num_inputs` inputs in all (B..B (k + 1), any shape) in a rectangle of
        `width` + 1 inputs per row: a plain step at B inputs, t_verify(B, `effective_inputs`) above."""
        values = num_inputs.double()
        seconds = [
            self.costs.plain(batch_size) if inputs <= batch_size
            else self.costs.verify(batch_size, effective_inputs(batch_size, inputs, width))
            for inputs in values.flatten().tolist()
        ]
        return torch.tensor(seconds, dtype=torch.float64).view_as(values)

    def plain_step_due(self) -> bool:
        """Whether the next step must be a plain one (nothing proposed, not even free drafts): the first of the
        call, a refresh of t_plain, or handed off."""
        if not self.feedback:
            return False
        return self.handoff.active or self.steps_since_plain is None or self.steps_since_plain >= PLAIN_REFRESH_STEPS

    def choose(self, cumulative: torch.Tensor, drafted: bool = True) -> torch.LongTensor:
        """cumulative `[B, k]` on the host (q_{b,j}, 0 where a row has no draft) -> drafts each row verifies `[B]`
        (0..k), on the host. Steps whose drafts came from the drafter (`drafted`) update the running mean E_w that
        `should_draft` reads; lookup-only steps do not (they say nothing of what drafting would bring). A due plain
        step verifies nothing; while the costs of verifying are unknown, each row verifies its first draft: the
        cheapest step that measures them (`feedback.OnlineStepCosts` prices every width from one timed step), where
        verifying all k cost a first call at B = 32 two plain steps' worth of time on the CPU testbed."""
        batch_size = cumulative.shape[0]
        cumulative = cumulative.double()
        if drafted:
            per_row = torch.cat([cumulative.new_zeros(batch_size, 1), cumulative.cumsum(1)], dim=1)
            self._remember(per_row.mean(0))
        if self.plain_step_due():
            counts = torch.zeros(batch_size, dtype=torch.long)
        elif not self.costs.verify_known:
            counts = (cumulative[:, :1] > 0).sum(1)
        else:
            counts = self._choose_packed(cumulative) if self.packed else self._choose_width(cumulative)
        if self.feedback and counts.any():
            self.variances.append(accepted_variance(cumulative, counts))
        return counts

    def stepped(self, proposed: bool) -> None:
        """The engine ran a step; `proposed`: with proposals (False: a plain step, which times t_plain)."""
        self.steps_since_plain = self.steps_since_plain + 1 if proposed else 0

    def _choose_width(self, cumulative: torch.Tensor) -> torch.LongTensor:
        """Padded steps: every row verifies its drafts up to the one width w* that maximises the rate."""
        batch_size = cumulative.shape[0]
        gain = torch.cat([cumulative.new_zeros(1), cumulative.sum(0).cumsum(0)])  # [k + 1] accepted drafts at w
        width = int(((batch_size + gain) / self.step_seconds(batch_size)).argmax())
        return (cumulative[:, :width] > 0).sum(1)

    def _choose_packed(self, cumulative: torch.Tensor) -> torch.LongTensor:
        """Packed steps, the paper's batch greedy under each rectangle width w = 0..k: candidates (b, j <= w) by
        decreasing q_{b,j} (a stable sort keeps each row's drafts in order, so every prefix of candidates is a union
        of row prefixes), the prefix of n candidates that maximises (B + gain_n) / t_packed(B + n, w), and the best
        of the k + 1 (the narrowest on ties)."""
        batch_size = cumulative.shape[0]
        best_rate, best_counts = 0.0, torch.zeros(batch_size, dtype=torch.long)
        for width in range(cumulative.shape[1] + 1):
            flat = cumulative[:, :width].flatten()
            gains, order = flat.sort(descending=True, stable=True)
            gain = torch.cat([flat.new_zeros(1), gains.cumsum(0)])  # [B w + 1]
            num_inputs = batch_size + torch.arange(gain.numel(), dtype=torch.float64)
            rates = (batch_size + gain) / self.packed_step_seconds(batch_size, num_inputs, width)
            best = int(rates.argmax())
            if float(rates[best]) > best_rate:
                chosen = torch.zeros_like(flat, dtype=torch.bool)
                chosen[order[:best]] = True
                best_rate, best_counts = float(rates[best]), (chosen & (flat > 0)).view(batch_size, width).sum(1)
        return best_counts

    def _remember(self, expected_per_row: torch.Tensor) -> None:
        if self.expected is None:
            self.expected = expected_per_row
        else:
            self.expected = EXPECTED_TOKENS_DECAY * self.expected + (1 - EXPECTED_TOKENS_DECAY) * expected_per_row

    def _rates(self, batch_size: int) -> torch.Tensor:
        """`[k + 1]` predicted committed tokens per second at width w, drafting costs included for w > 0."""
        seconds = self.step_seconds(batch_size)
        seconds[1:] += self.costs.draft(batch_size)
        return batch_size * (1 + self.expected) / seconds

    def _drafting_pays(self, batch_size: int) -> bool:
        """max_w B (1 + E_w) / (t(B, w) + t_d(B)) > B / t_plain(B)."""
        return bool(self._rates(batch_size)[1:].max() > batch_size / self.costs.plain(batch_size))

    def speculation_pays(self, batch_size: int) -> bool:
        """Whether a call at this batch size should run the engine at all rather than plain decoding (True while
        E_w or the costs are unknown); see the module docstring."""
        if self.expected is None or not self.costs.known:
            return True
        plain_rate = batch_size / self.costs.plain(batch_size)
        return bool(self._rates(batch_size)[1:].max() > (1 + ENGINE_OVERHEAD) * plain_rate)

    def should_draft(self, batch_size: int) -> bool:
        """Whether drafting for the next step is expected to pay (or a probe is due); never before a plain step."""
        if batch_size == 0 or self.plain_step_due():
            return False
        if self.expected is None or not self.costs.known:
            return True
        if self._drafting_pays(batch_size):
            self.steps_without_drafting, self.probe_backoff = 0, 1
            return True
        if self.steps_without_drafting >= self.probe_interval * self.probe_backoff:
            self.steps_without_drafting = 0
            self.probe_backoff = min(2 * self.probe_backoff, MAX_PROBE_BACKOFF) if self.feedback else 1
            return True
        self.steps_without_drafting += 1
        return False

    def observe(self, steps: list[tuple[tuple, list[float]]]) -> None:
        """Timed steps (`StepClock.read`): ("step", B, width, [drafts verified, accepted, rows still generating],
        proposed, drafting) with the seconds of verification (forward, verify, commit) and of proposing for the next
        step (propose, retire rows, compact); `proposed`: whether the step had proposals (False: a plain step by
        this schedule's word; every step of width 0 times t_plain); `drafting`: the proposing that followed (None:
        skipped, False: free drafts only, True: the drafter ran). Updates the costs and the hand-off guard, which
        weighs the steps that verified drafts and the proposing that follows any step (`HandOff.observe`)."""
        if not self.feedback:
            return
        for (_, batch_size, width, counts, proposed, drafting), (verify_seconds, draft_seconds) in steps:
            drafts, accepted, num_live = counts
            variance = 0.0
            if width:
                self.costs.observe_verify(batch_size, batch_size + drafts, verify_seconds)
                variance = self.variances.popleft()
            else:  # a plain step's forward, whether or not there were proposals (feedback.py: drift)
                self.costs.observe_plain(batch_size, verify_seconds + (draft_seconds if drafting is None else 0.0))
                if self.handoff.active and not proposed:
                    self.handoff.plain_step()
            if drafting:
                self.costs.observe_draft(batch_size, draft_seconds)
            if proposed or drafting is not None:
                self.handoff.observe(batch_size, num_live, num_live + accepted, verify_seconds, draft_seconds,
                                     verified=width > 0, predicted_variance=variance)
