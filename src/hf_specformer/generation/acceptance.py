"""Acceptance estimates (Speculative Verification, arXiv 2509.24328, eq. 3-4): q_{b,j}, the chance that drafts 1..j
of row b are all accepted, from `confidence` (P_d(d)) or `sv`, a companion's S = sum_v min(P_d(v), P_c(v)) and
A = min(1, P_c(d) / P_d(d)). An `AcceptanceTable` maps binned signals to rates per source and slot; its offline
counts are a prior that each call's observations move.
"""

from __future__ import annotations

import torch

DRAFTER, LOOKUP, NO_DRAFT = 0, 1, 2
"""Draft sources: the drafter's network, a free source of fixed drafts (lookup, suffix, an oracle), or none."""

NUM_SOURCES = 2
PRIOR_TRIALS = 32.0
"""Most verified drafts an offline bin counts for, so that online observations can move it."""

DEFAULT_PRIOR_TRIALS = 4.0
"""Weight of the uncalibrated prior (the signal itself) when no offline table exists."""

DEFAULT_NUM_BINS = 10
"""Bins per signal of an uncalibrated table."""

SIGNALS = {"confidence": 1, "sv": 2}
"""Signal name -> number of features."""


def draft_confidence(draft_probs: torch.Tensor, draft_ids: torch.LongTensor, sampled: bool = False) -> torch.Tensor:
    """`[B, k, V]`, `[B, k]` -> `[B, k]` q_j(d_j), or for `sampled` drafts its expectation sum_v q_j(v)^2 (what a row
    verifies must not depend on the tokens sampled, or the output leaves the target's distribution)."""
    if sampled:
        return draft_probs.square().sum(-1)
    return draft_probs.gather(2, draft_ids[..., None]).squeeze(2)


def sv_features(draft_probs, companion_probs, draft_ids, sampled: bool = False) -> torch.Tensor:
    """P_d, P_c `[B, k, V]`, drafts `[B, k]` -> `[B, k, 2]` (S, A); for `sampled` drafts A's expectation, S."""
    overlap = torch.minimum(draft_probs, companion_probs).sum(-1)
    if sampled:
        return torch.stack([overlap, overlap], dim=-1).float()
    p_d = draft_probs.gather(2, draft_ids[..., None]).squeeze(2)
    p_c = companion_probs.gather(2, draft_ids[..., None]).squeeze(2)
    ratio = torch.where(p_d > 0, p_c / p_d.clamp(min=torch.finfo(p_d.dtype).tiny), torch.ones_like(p_d)).clamp(max=1)
    return torch.stack([overlap, ratio], dim=-1).float()


def draft_features(signal: str, draft_probs, draft_ids, sources, companion_probs=None, sampled: bool = False,
                   fixed_confidence=None) -> torch.Tensor:
    """The signal of each draft `[B, k, F]`; a fixed draft is one-hot: confidence 1 (or `fixed_confidence` `[B, k]`),
    (S, A) both P_c(d). `draft_probs` `[B, k, V]`: None where the network did not draft."""
    lookup = (sources == LOOKUP)[..., None]
    if signal == "sv":
        p_c = companion_probs.gather(2, draft_ids[..., None]).float()
        fixed = torch.cat([p_c, p_c], dim=-1)
        network = fixed if draft_probs is None else sv_features(draft_probs, companion_probs, draft_ids, sampled)
    else:
        fixed = torch.ones(*draft_ids.shape, 1, device=draft_ids.device) if fixed_confidence is None \
            else fixed_confidence[..., None].float()
        network = fixed if draft_probs is None else draft_confidence(draft_probs, draft_ids, sampled)[..., None].float()
    return torch.where(lookup, fixed, network)


def uniform_edges(num_bins: int) -> list[float]:
    """Interior edges of `num_bins` equal-width bins over [0, 1]."""
    return [i / num_bins for i in range(1, num_bins)]


class AcceptanceTable:
    """P(accept | source, slot, binned signal) = (accepted + prior_trials * prior_rate) / (verified + prior_trials),
    all `[NUM_SOURCES, num_slots, *bins]` (default prior: each bin's centre). `expected_accepted` `[num_slots + 1]`:
    E_w, accepted drafts per row when verifying w, on the calibration data (None: unknown)."""

    def __init__(self, signal: str, edges: list[list[float]], num_slots: int, prior_rate=None, prior_trials=None,
                 expected_accepted: list[float] | None = None):
        if signal not in SIGNALS or len(edges) != SIGNALS[signal]:
            raise ValueError(f"signal must be one of {sorted(SIGNALS)} with matching edges, got {signal!r}.")
        self.signal, self.num_slots, self.expected_accepted = signal, num_slots, expected_accepted
        self.edges = [torch.tensor(sorted(e), dtype=torch.float32) for e in edges]
        shape = (NUM_SOURCES, num_slots, *(len(e) + 1 for e in self.edges))
        if prior_rate is None:
            bounds = torch.cat([torch.zeros(1), self.edges[-1], torch.ones(1)]).double()
            prior_rate = ((bounds[1:] + bounds[:-1]) / 2).expand(shape)
        self.prior_rate = prior_rate.double().reshape(shape).clone()
        self.prior_trials = torch.full(shape, DEFAULT_PRIOR_TRIALS, dtype=torch.float64) if prior_trials is None \
            else prior_trials.double().reshape(shape)
        self.accepted = torch.zeros(shape, dtype=torch.float64)
        self.trials = torch.zeros(shape, dtype=torch.float64)

    @classmethod
    def uncalibrated(cls, signal: str, num_slots: int) -> "AcceptanceTable":
        return cls(signal, [uniform_edges(DEFAULT_NUM_BINS)] * SIGNALS[signal], num_slots)

    def to(self, device) -> "AcceptanceTable":
        """Moves the table to `device` in place (estimates then need no copy to the host)."""
        self.edges = [edges.to(device) for edges in self.edges]
        for name in ("prior_rate", "prior_trials", "accepted", "trials"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def _cells(self, features, sources, slots) -> torch.LongTensor:
        device = self.trials.device
        index = sources.to(device).clamp(max=NUM_SOURCES - 1) * self.num_slots
        index = index + slots.to(device).clamp(max=self.num_slots - 1)
        for f, edges in enumerate(self.edges):
            values = features[:, f].float().to(device).contiguous()
            index = index * (len(edges) + 1) + torch.bucketize(values, edges, right=True)
        return index

    def estimate(self, features: torch.Tensor, sources, slots) -> torch.Tensor:
        """features `[N, F]`, sources `[N]`, slots `[N]` (0-based) -> P(accept) `[N]` float64."""
        cells = self._cells(features, sources, slots)
        prior_trials = self.prior_trials.flatten()[cells]
        rate = (self.accepted.flatten()[cells] + prior_trials * self.prior_rate.flatten()[cells]) / (
            self.trials.flatten()[cells] + prior_trials)
        return rate.to(features.device)

    def add(self, features, sources, slots, accepted, observed=None) -> None:
        """Counts outcomes of verified drafts, weighted by `observed` `[N]` (a weight: no host read)."""
        cells = self._cells(features, sources, slots)
        weight = torch.ones_like(cells, dtype=torch.float64) if observed is None else observed.to(cells.device).double()
        self.trials.view(-1).index_add_(0, cells, weight)
        self.accepted.view(-1).index_add_(0, cells, accepted.to(cells.device).double() * weight)

    def as_prior(self, max_trials: float = PRIOR_TRIALS) -> "AcceptanceTable":
        """A fresh table whose prior is this one's counts, each bin weighing at most `max_trials` drafts."""
        total = self.trials + self.prior_trials
        rate = (self.accepted + self.prior_trials * self.prior_rate) / total
        return AcceptanceTable(self.signal, [e.tolist() for e in self.edges], self.num_slots, rate,
                               total.clamp(max=max_trials), self.expected_accepted)

    def to_dict(self) -> dict:
        """Plain lists (for a model config); `from_dict` reads it back."""
        return {"signal": self.signal, "edges": [e.tolist() for e in self.edges], "num_slots": self.num_slots,
                "rate": self.as_prior(float("inf")).prior_rate.flatten().tolist(),
                "trials": (self.trials + self.prior_trials).flatten().tolist(),
                "expected_accepted": self.expected_accepted}

    @classmethod
    def from_dict(cls, data: dict, max_trials: float = PRIOR_TRIALS) -> "AcceptanceTable":
        trials = torch.tensor(data["trials"], dtype=torch.float64)
        return cls(data["signal"], data["edges"], data["num_slots"], torch.tensor(data["rate"], dtype=torch.float64),
                   trials.clamp(max=max_trials), data.get("expected_accepted"))


def observed_outcomes(num_accepted: torch.LongTensor, num_drafts: torch.LongTensor | int, k: int):
    """`[B, k]` observed (verified after accepted drafts) and accepted drafts of a verification."""
    positions = torch.arange(k, device=num_accepted.device)[None, :]
    verified = num_drafts[:, None] if isinstance(num_drafts, torch.Tensor) else num_drafts
    observed = (positions <= num_accepted[:, None]) & (positions < verified)
    return observed, positions < num_accepted[:, None]


class AcceptanceEstimator:
    """The estimates of one call: a table and the online counts its steps add."""

    def __init__(self, table: AcceptanceTable | dict, device):
        table = AcceptanceTable.from_dict(table) if isinstance(table, dict) else table
        self.table = (table.as_prior() if table.trials.sum() > 0 else table).to(device)

    @property
    def signal(self) -> str:
        return self.table.signal

    def estimate(self, draft_probs, draft_ids, sources, companion_probs=None, sampled: bool = False,
                 fixed_confidence=None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (q `[B, k]`, 0 from a position without a draft on; the signals `[B, k, F]`), as `draft_features`."""
        batch, k = draft_ids.shape
        features = draft_features(self.signal, draft_probs, draft_ids, sources, companion_probs, sampled,
                                  fixed_confidence)
        slots = torch.arange(k, device=draft_ids.device).expand(batch, k).flatten()
        per_draft = self.table.estimate(features.flatten(0, 1), sources.flatten(), slots)
        return per_draft.masked_fill(sources.flatten() == NO_DRAFT, 0).view(batch, k).cumprod(dim=1), features

    def observe(self, features, sources, num_accepted: torch.LongTensor, num_drafts: torch.LongTensor | int) -> None:
        """Adds what a step observed of its drafts (`features` `[B, k, F]` and `sources` `[B, k]` from `estimate`)."""
        batch, k = sources.shape
        observed, accepted = observed_outcomes(num_accepted, num_drafts, k)
        slots = torch.arange(k, device=sources.device).expand(batch, k).flatten()
        self.table.add(features.flatten(0, 1), sources.flatten(), slots, accepted.flatten(), observed.flatten())
