"""Speculation statistics of one call, and the rows reported as they finish. A *row-step* is one live row in one
verification forward; `tokens_per_step` (kappa) counts committed tokens per row-step, before EOS or length cuts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecStats:
    """What a call did, summed over rows and steps."""

    num_draft_tokens: int  # k
    steps: int = 0  # target forwards after the prefill
    row_steps: int = 0  # sum over steps of the rows still generating
    drafted: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted
    accepted_at: list[int] = field(default_factory=list)  # [k] how often drafted position j (0-based) was accepted
    width_counts: list[int] = field(default_factory=list)  # [k + 1] steps whose widest row verified w (0: plain)
    drafting_steps: int = 0  # steps whose drafts the drafter's network made (the others: free drafts or none)
    looked_up: int = 0  # drafts verified that came from a free source (prompt lookup, suffix drafts, an oracle)
    predicted_accepted: float = 0.0  # the scheduler's expected accepted drafts over those verified (0: none)
    handoffs: int = 0  # times the guard handed the call over to plain steps
    host_reads: int = 0  # device-to-host reads (one per step, more where rows finish and are reported)
    tokens_per_row: list[float] = field(default_factory=list)  # per row of the call, its kappa

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.num_draft_tokens
        self.width_counts = self.width_counts or [0] * (self.num_draft_tokens + 1)

    def record(self, width: int, verified: int, accepted: list[int], live: list[bool]) -> None:
        """One step: its widest row's drafts, drafts verified, and per row accepted drafts and whether it was live."""
        self.steps += 1
        self.width_counts[width] += 1
        self.drafted += verified
        self.row_steps += sum(live)
        self.accepted += sum(accepted)
        rows_with = [0] * (self.num_draft_tokens + 1)  # rows that accepted exactly n drafts
        for count in accepted:
            rows_with[count] += 1
        for j in range(self.num_draft_tokens - 1, -1, -1):  # rows that accepted more than j
            rows_with[j] += rows_with[j + 1]
            self.accepted_at[j] += rows_with[j + 1]

    @property
    def tokens_per_step(self) -> float:
        """kappa: committed tokens per row-step, bonus or correction token included."""
        return (self.accepted + self.row_steps) / max(self.row_steps, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)

    @property
    def drafts_per_step(self) -> float:
        return self.drafted / max(self.row_steps, 1)

    @property
    def predicted_acceptance_rate(self) -> float:
        return self.predicted_accepted / max(self.drafted, 1)

    @property
    def acceptance_by_position(self) -> list[float]:
        """Share of row-steps whose drafted position j was accepted."""
        return [count / max(self.row_steps, 1) for count in self.accepted_at]

    @property
    def mean_width(self) -> float:
        return sum(w * n for w, n in enumerate(self.width_counts)) / max(self.steps, 1)

    def to_dict(self) -> dict:
        """Plain numbers, for JSON reports."""
        return {**asdict(self), "tokens_per_step": self.tokens_per_step, "acceptance_rate": self.acceptance_rate,
                "drafts_per_step": self.drafts_per_step, "acceptance_by_position": self.acceptance_by_position,
                "mean_width": self.mean_width, "predicted_acceptance_rate": self.predicted_acceptance_rate}


@dataclass
class FinishedRow:
    """One row that ended: its index in the call, its tokens (EOS included), its steps and accepted drafts."""

    row: int
    tokens: list[int]
    steps: int
    accepted: int


class RowCounts:
    """Per row of the call: steps and accepted drafts, and who was told of its end (`callback`, or nobody)."""

    def __init__(self, num_rows: int, callback=None):
        self.steps, self.accepted = [0] * num_rows, [0] * num_rows
        self.callback, self.reported = callback, set()

    def record(self, rows: list[int], accepted: list[int], live: list[bool]) -> None:
        for row, count, is_live in zip(rows, accepted, live):
            self.steps[row] += is_live
            self.accepted[row] += count

    def take(self, rows: list[int]) -> None:
        """`rows` begin (again, or beyond the call's rows so far) with no steps and nobody told."""
        grow = max(rows) + 1 - len(self.steps)
        self.steps, self.accepted = self.steps + [0] * grow, self.accepted + [0] * grow
        for row in rows:
            self.steps[row] = self.accepted[row] = 0
            self.reported.discard(row)

    def kappa(self) -> list[float]:
        return [(s + a) / s if s else 1.0 for s, a in zip(self.steps, self.accepted)]

    def report(self, rows: list[int], tokens: list[list[int]]) -> None:
        """Calls back once for each of `rows` (finished) with its generated `tokens`."""
        for row, generated in zip(rows, tokens):
            if self.callback is not None and row not in self.reported:
                self.reported.add(row)
                self.callback(FinishedRow(row, generated, self.steps[row], self.accepted[row]))
