"""Acceptance estimates of drafted tokens, the numbers the goodput scheduler weighs (`scheduling.py`).

For drafted position j of row b an estimator gives p_{b,j} = P(d_j accepted | d_1 .. d_{j-1} accepted); their running
product q_{b,j} = p_{b,1} ... p_{b,j} is the chance that drafts 1..j are all accepted, so verifying position j adds
q_{b,j} expected tokens (Speculative Verification, arXiv 2509.24328, eq. 3-4).

Signals (one or two numbers per draft):
- `confidence`: q_j(d_j), the drafter's own (processed) probability of the token it drafted.
- `sv`: Speculative Verification's pair from a companion distribution P_c at the same position:
  S = sum_v min(P_d(v), P_c(v)) (overlap of draft and companion) and A = min(1, P_c(d) / P_d(d)).

The map from signal to probability is an `AcceptanceTable`: counts (accepted, verified) per bin, as in the paper's
binned profile (Def. D.7-D.8). Choices where the paper is silent:
- Bins have equal mass on the calibration data (the paper's "adaptive binning" scheme is not specified).
- Tables are kept per *source* (drafter, prompt lookup) and per drafted slot j: a looked-up draft has confidence 1
  by construction and its own acceptance rate, and a slot-j draft of SpecFormer is rarer right than a slot-1 draft
  at equal confidence. (The paper's table depends on (S, A) only.)
- Labels are conditional: a draft counts only when every draft before it was accepted, which is what q needs and
  what verification observes (positions after a rejection are never seen).
- The offline counts act as a prior of at most `PRIOR_TRIALS` verified drafts per bin, and every generate call adds
  what its own verifications observe (as vLLM's estimator refits online): a domain unlike the calibration data
  moves the estimates within a few dozen drafts per bin. With no offline table the prior is the signal itself
  (`confidence` p = q_j(d_j); `sv` p = A) with a weight of `DEFAULT_PRIOR_TRIALS`.
- Greedy labels (draft == the target's argmax). Under sampling the same table is used; the online counts then
  record sampling acceptances.
"""

from __future__ import annotations

import torch

DRAFTER, LOOKUP, NO_DRAFT = 0, 1, 2
"""Draft sources: the learned drafter, prompt lookup, or no draft at that position (estimate 0)."""

NUM_SOURCES = 2
PRIOR_TRIALS = 32.0
"""Most verified drafts an offline bin counts for, so online observations can move it."""

DEFAULT_PRIOR_TRIALS = 4.0
"""Weight of the uncalibrated prior (the signal itself) when no offline table exists."""

SIGNALS = {"confidence": 1, "sv": 2}
"""Signal name -> number of features."""


def draft_confidence(draft_probs: torch.Tensor, draft_ids: torch.LongTensor, sampled: bool = False) -> torch.Tensor:
    """draft_probs `[B, k, V]`, draft_ids `[B, k]` -> `[B, k]`: q_j(d_j), or with `sampled` drafts its expectation
    over the draft, sum_v q_j(v)^2.

    Under sampling, how many drafts a row verifies must not depend on which tokens were sampled: verifying only
    drafts the target is likely to accept skips the rejections that rejection sampling relies on, and the output
    leaves the target's distribution (measured: chi-square p < 1e-5 on the sampling test's joint of three tokens).
    So sampled drafts are scored by their distributions only; greedy and lookup drafts (one-hot q) keep q_j(d_j)."""
    if sampled:
        return draft_probs.square().sum(-1)
    return draft_probs.gather(2, draft_ids[..., None]).squeeze(2)


def draft_features(
    signal: str, draft_probs: torch.Tensor | None, draft_ids: torch.LongTensor, sources: torch.LongTensor,
    companion_probs: torch.Tensor | None = None, sampled: bool = False, fixed_confidence: torch.Tensor | None = None,
) -> torch.Tensor:
    """The signal of each draft -> `[B, k, F]` (F = `SIGNALS[signal]`).

    Args:
        signal: "confidence" (`draft_confidence`) or "sv" (Speculative Verification's (S, A)).
        draft_probs: `[B, k, V]` processed draft distributions of the network's drafts, or None where none drafted.
        draft_ids: `[B, k]` the drafts; sources: `[B, k]` their sources.
        companion_probs: `[B, k, V]` P_c (signal "sv").
        sampled: the network's drafts were sampled (`draft_confidence`).
        fixed_confidence: `[B, k]` the confidence a free source gives its drafts (None: 1).

    A looked-up draft's distribution is one-hot, so its confidence is 1 (or what its source says, as suffix drafts'
    frequency) and its (S, A) are both P_c(d); it needs no distribution over the vocabulary. Entries at `NO_DRAFT`
    positions are meaningless (estimated 0 anyway)."""
    lookup = (sources == LOOKUP)[..., None]
    if signal == "sv":
        p_c = companion_probs.gather(2, draft_ids[..., None]).float()
        fixed = torch.cat([p_c, p_c], dim=-1)
        network = sv_features(draft_probs, companion_probs, draft_ids, sampled) if draft_probs is not None else fixed
    else:
        fixed = torch.ones(*draft_ids.shape, 1, device=draft_ids.device) if fixed_confidence is None \
            else fixed_confidence[..., None].float()
        network = draft_confidence(draft_probs, draft_ids, sampled)[..., None].float() if draft_probs is not None \
            else fixed
    return torch.where(lookup, fixed, network)


def sv_features(
    draft_probs: torch.Tensor, companion_probs: torch.Tensor, draft_ids: torch.LongTensor, sampled: bool = False
) -> torch.Tensor:
    """P_d, P_c `[B, k, V]`, draft_ids `[B, k]` -> `[B, k, 2]`: (S, A) of Speculative Verification. With `sampled`
    drafts A is replaced by its expectation over the draft, E_{d~P_d} min(1, P_c(d) / P_d(d)) = S (see
    `draft_confidence` for why a sampled draft's own token may not be read)."""
    overlap = torch.minimum(draft_probs, companion_probs).sum(-1)  # S
    if sampled:
        return torch.stack([overlap, overlap], dim=-1).float()
    p_d = draft_probs.gather(2, draft_ids[..., None]).squeeze(2)
    p_c = companion_probs.gather(2, draft_ids[..., None]).squeeze(2)
    ratio = torch.where(p_d > 0, p_c / p_d.clamp(min=torch.finfo(p_d.dtype).tiny), torch.ones_like(p_d)).clamp(max=1)
    return torch.stack([overlap, ratio], dim=-1).float()


def uniform_edges(num_bins: int) -> list[float]:
    """Interior edges of `num_bins` equal-width bins over [0, 1]."""
    return [i / num_bins for i in range(1, num_bins)]


def quantile_edges(values: torch.Tensor, num_bins: int) -> list[float]:
    """Interior edges of (about) equal-mass bins of `values` `[N]`; repeated edges are dropped."""
    quantiles = torch.linspace(0, 1, num_bins + 1, dtype=torch.float64)[1:-1]
    edges = torch.quantile(values.double(), quantiles).unique()
    return [float(edge) for edge in edges if 0.0 < edge < 1.0]


class AcceptanceTable:
    """P(accept | source, slot, binned signal): offline prior counts plus online counts.

    Shapes: `features` `[N, F]` (F = 1 or 2 signal values in [0, 1]), `sources` `[N]` (DRAFTER or LOOKUP), `slots`
    `[N]` (0-based drafted position; slots past the table's last use the last). Estimates are
    (accepted + prior_trials * prior_rate) / (verified + prior_trials) per bin.

    Args:
        signal: "confidence" or "sv".
        edges: per feature, the interior bin edges.
        num_slots: drafted positions with their own bins.
        prior_rate, prior_trials: `[NUM_SOURCES, num_slots, *bins]`; default: the signal's bin centre with weight
            `DEFAULT_PRIOR_TRIALS` (see the module docstring).
        expected_accepted: `[num_slots + 1]` E_w, the drafter's expected accepted drafts per row when verifying w
            drafts, on the calibration data (what the goodput scheduler predicts with before a call's first step);
            None when unknown.
    """

    def __init__(
        self,
        signal: str,
        edges: list[list[float]],
        num_slots: int,
        prior_rate: torch.Tensor | None = None,
        prior_trials: torch.Tensor | None = None,
        expected_accepted: list[float] | None = None,
    ):
        if signal not in SIGNALS or len(edges) != SIGNALS[signal]:
            raise ValueError(f"signal must be one of {sorted(SIGNALS)} with matching edges, got {signal!r}.")
        self.signal = signal
        self.edges = [torch.tensor(sorted(e), dtype=torch.float32) for e in edges]
        self.num_slots = num_slots
        shape = (NUM_SOURCES, num_slots, *(len(e) + 1 for e in self.edges))
        self.prior_rate = self._default_rate(shape) if prior_rate is None else prior_rate.double().reshape(shape)
        self.prior_trials = (
            torch.full(shape, DEFAULT_PRIOR_TRIALS, dtype=torch.float64) if prior_trials is None
            else prior_trials.double().reshape(shape)
        )
        self.accepted = torch.zeros(shape, dtype=torch.float64)
        self.trials = torch.zeros(shape, dtype=torch.float64)
        self.expected_accepted = expected_accepted

    def _default_rate(self, shape) -> torch.Tensor:
        """The signal as its own estimate: the centre of each bin of the last feature (q_j(d_j), or A)."""
        edges = torch.cat([torch.zeros(1), self.edges[-1], torch.ones(1)]).double()
        centres = (edges[1:] + edges[:-1]) / 2
        return centres.expand(shape).clone()

    def to(self, device: torch.device | str) -> "AcceptanceTable":
        """Moves the table to `device` (in place; returns it): estimates and counts then stay on the device of the
        drafts, with no copy to the host."""
        self.edges = [edges.to(device) for edges in self.edges]
        for name in ("prior_rate", "prior_trials", "accepted", "trials"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def _cells(self, features: torch.Tensor, sources: torch.LongTensor, slots: torch.LongTensor) -> torch.LongTensor:
        """Flat cell index `[N]`, on the table's device."""
        device = self.trials.device
        index = sources.to(device).clamp(max=NUM_SOURCES - 1) * self.num_slots
        index = index + slots.to(device).clamp(max=self.num_slots - 1)
        for f, edges in enumerate(self.edges):
            values = features[:, f].float().to(device).contiguous()
            index = index * (len(edges) + 1) + torch.bucketize(values, edges, right=True)
        return index

    def estimate(self, features: torch.Tensor, sources: torch.LongTensor, slots: torch.LongTensor) -> torch.Tensor:
        """P(accept) `[N]` (float64, on the features' device)."""
        cells = self._cells(features, sources, slots)
        prior_trials = self.prior_trials.flatten()[cells]
        rate = (self.accepted.flatten()[cells] + prior_trials * self.prior_rate.flatten()[cells]) / (
            self.trials.flatten()[cells] + prior_trials
        )
        return rate.to(features.device)

    def add(
        self, features: torch.Tensor, sources: torch.LongTensor, slots: torch.LongTensor, accepted: torch.Tensor,
        observed: torch.Tensor | None = None,
    ) -> None:
        """Counts outcomes (`accepted` `[N]` bool or 0/1) of verified drafts; with `observed` `[N]` only where it is
        True (a weight rather than a selection, so no count depends on a host read)."""
        cells = self._cells(features, sources, slots)
        weight = torch.ones_like(cells, dtype=torch.float64) if observed is None else observed.to(cells.device).double()
        self.trials.view(-1).index_add_(0, cells, weight)
        self.accepted.view(-1).index_add_(0, cells, accepted.to(cells.device).double() * weight)

    def as_prior(self, max_trials: float = PRIOR_TRIALS) -> "AcceptanceTable":
        """A fresh table whose prior is this table's counts (smoothed toward its old prior), each bin weighing at
        most `max_trials` verified drafts; its online counts are empty."""
        total = self.trials + self.prior_trials
        rate = (self.accepted + self.prior_trials * self.prior_rate) / total
        return AcceptanceTable(
            self.signal, [e.tolist() for e in self.edges], self.num_slots, rate, total.clamp(max=max_trials),
            self.expected_accepted,
        )

    def to_dict(self) -> dict:
        """Plain lists (for a model config); `from_dict` reads it back."""
        return {
            "signal": self.signal,
            "edges": [e.tolist() for e in self.edges],
            "num_slots": self.num_slots,
            "rate": self.as_prior(float("inf")).prior_rate.flatten().tolist(),
            "trials": (self.trials + self.prior_trials).flatten().tolist(),
            "expected_accepted": self.expected_accepted,
        }

    @classmethod
    def from_dict(cls, data: dict, max_trials: float = PRIOR_TRIALS) -> "AcceptanceTable":
        """The table saved by `to_dict`, as a prior of at most `max_trials` drafts per bin."""
        trials = torch.tensor(data["trials"], dtype=torch.float64)
        return cls(
            data["signal"], data["edges"], data["num_slots"],
            torch.tensor(data["rate"], dtype=torch.float64), trials.clamp(max=max_trials),
            data.get("expected_accepted"),
        )

    @classmethod
    def fit(
        cls, signal: str, features: torch.Tensor, sources: torch.LongTensor, slots: torch.LongTensor,
        accepted: torch.Tensor, num_bins: int = 10, num_slots: int | None = None,
    ) -> "AcceptanceTable":
        """Equal-mass bins of each feature over the drafter's drafts, then the counts of every cell; E_w from the
        accepted drafts per slot over the positions drafted (every position is observed at slot 0)."""
        num_slots = num_slots or int(slots.max()) + 1
        drafter = sources == DRAFTER
        edges = [quantile_edges(features[drafter, f], num_bins) for f in range(features.shape[1])]
        per_slot = torch.bincount(slots[drafter], weights=accepted[drafter].double(), minlength=num_slots)
        positions = max(int((slots[drafter] == 0).sum()), 1)
        expected = [0.0] + (per_slot[:num_slots].cumsum(0) / positions).tolist()
        table = cls(signal, edges, num_slots, expected_accepted=expected)
        table.add(features, sources, slots, accepted)
        return table


def cumulative_acceptance(per_draft: torch.Tensor) -> torch.Tensor:
    """p `[B, k]` (conditional acceptance of each draft) -> q `[B, k]`: the chance drafts 1..j are all accepted."""
    return per_draft.cumprod(dim=1)


def accepted_variance(cumulative: torch.Tensor, num_drafts: torch.LongTensor) -> float:
    """cumulative q `[B, k]`, drafts each row verifies `[B]` -> the variance of the drafts the step accepts, over all
    rows, taken as independent: row b accepts N_b of its n_b drafts with P(N_b >= j) = q_{b,j} (j <= n_b), so
    E[N_b] = sum_j q_{b,j} and E[N_b^2] = sum_j (2j - 1) q_{b,j}."""
    positions = torch.arange(1, cumulative.shape[1] + 1, dtype=cumulative.dtype)
    verified = cumulative * (positions[None, :] <= num_drafts[:, None])
    mean = verified.sum(1)
    second = (verified * (2 * positions - 1)).sum(1)
    return float((second - mean.square()).sum())


def observed_outcomes(num_accepted: torch.LongTensor, num_drafts: torch.LongTensor, k: int):
    """What a verification step tells about each draft: `[B, k]` observed (every draft before it was accepted and
    it was verified) and accepted."""
    positions = torch.arange(k, device=num_accepted.device)[None, :]
    observed = (positions <= num_accepted[:, None]) & (positions < num_drafts[:, None])
    return observed, positions < num_accepted[:, None]


class AcceptanceEstimator:
    """The estimates of one generate call: signal features of each step's drafts, a table, and online counts.

    Args:
        table: the prior table (its online counts start empty); `signal` "sv" needs companion distributions.
        device: where the drafts are (the table moves there).
    """

    def __init__(self, table: AcceptanceTable, device: torch.device | str = "cpu"):
        self.table = (table.as_prior() if table.trials.sum() > 0 else table).to(device)
        self._pending: tuple[torch.Tensor, torch.LongTensor, torch.LongTensor] | None = None

    @property
    def signal(self) -> str:
        return self.table.signal

    def estimate(
        self, draft_probs: torch.Tensor | None, draft_ids: torch.LongTensor, sources: torch.LongTensor,
        companion_probs: torch.Tensor | None = None, sampled: bool = False,
        fixed_confidence: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """P_d `[B, k, V]` (None: no network drafts), drafts `[B, k]`, sources `[B, k]`, P_c `[B, k, V]` (signal
        "sv") -> q `[B, k]`, the chance that drafts 1..j are all accepted (0 from a position without a draft on).
        `sampled`: the network's drafts were sampled, so the signals read their distributions only
        (`draft_confidence`); `fixed_confidence`: see `draft_features`."""
        batch, k = draft_ids.shape
        features = draft_features(self.signal, draft_probs, draft_ids, sources, companion_probs, sampled,
                                  fixed_confidence)
        slots = torch.arange(k, device=draft_ids.device).expand(batch, k)
        features, sources, slots = features.flatten(0, 1), sources.flatten(), slots.flatten()
        per_draft = self.table.estimate(features, sources, slots).masked_fill(sources == NO_DRAFT, 0.0)
        self._pending = (features, sources, slots)
        return cumulative_acceptance(per_draft.view(batch, k))

    def observe(self, num_accepted: torch.LongTensor, num_drafts: torch.LongTensor) -> None:
        """Adds the outcomes the last step observed for the drafts of the last `estimate`."""
        features, sources, slots = self._pending
        num_slots = features.shape[0] // num_accepted.numel()
        observed, accepted = observed_outcomes(num_accepted, num_drafts, num_slots)
        self.table.add(features, sources, slots, accepted.flatten(), observed.flatten())
