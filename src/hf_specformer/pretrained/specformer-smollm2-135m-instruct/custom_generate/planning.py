"""What a step verifies: a proposal's drafts turned into tokens (logits processing, argmax or sampling, fixed drafts in
place), their acceptance estimated, and the schedule's choice of how many each row verifies."""

from __future__ import annotations

import torch

from .acceptance import (
    DRAFTER,
    LOOKUP,
    SIGNALS,
    AcceptanceEstimator,
    AcceptanceTable,
    draft_features,
    uniform_edges,
)
from .batch import RaggedBatch
from .drafting import Proposal
from .host import HostReads
from .processing import RaggedLogitsProcessor
from .costs import StepCostModel
from .scheduling import FixedSchedule, GoodputSchedule, Schedule
from .seeding import TokenSelector
from .speculation import SpeculationConfig


DEFAULT_NUM_BINS = 10
"""Bins per signal of an uncalibrated acceptance table."""


def draft_tokens(batch: RaggedBatch, processor: RaggedLogitsProcessor, proposal: Proposal, selector: TokenSelector,
                 needs_probs: bool) -> tuple[torch.LongTensor, torch.LongTensor, torch.Tensor | None]:
    """A proposal -> draft ids `[B, k]` (written as scratch after each row's prefix), their sources `[B, k]`, and the
    processed probabilities `[B, k, V]` of the network's drafts (None when it did not draft, or without
    `needs_probs`). A network draft at slot j is processed with the prefix committed + drafts 1..j-1, one slot at a
    time when a processor reads the prefix; fixed drafts (lookup) take the place of the network's where their source
    says so, unprocessed."""
    sources = proposal.sources
    if sources is None:
        sources = torch.full(proposal.logits.shape[:2], DRAFTER, dtype=torch.long, device=proposal.logits.device)
    fixed = (sources == LOOKUP) if proposal.ids is not None else None
    if not proposal.drafted:
        batch.write(proposal.ids)
        return proposal.ids, sources, None

    def select(scores: torch.Tensor, slots: slice) -> torch.LongTensor:
        ids = selector(scores, batch, offset=slots.start or 0)
        return ids if fixed is None else torch.where(fixed[:, slots], proposal.ids[:, slots], ids)

    if not processor.reads_prefix:
        scores = processor(batch, proposal.logits)  # [B, k, V]
        draft_ids = select(scores, slice(None))
        batch.write(draft_ids)
    else:
        ids, all_scores = [], []
        for j in range(proposal.logits.shape[1]):
            all_scores.append(processor(batch, proposal.logits[:, j : j + 1], offset=j))
            ids.append(select(all_scores[-1], slice(j, j + 1)))
            batch.write(ids[-1], offset=j)
        draft_ids, scores = torch.cat(ids, dim=1), torch.cat(all_scores, dim=1)
    return draft_ids, sources, scores.softmax(-1) if needs_probs else None


def draft_distributions(draft_ids: torch.LongTensor, sources: torch.LongTensor, draft_probs: torch.Tensor | None,
                         vocab_size: int) -> torch.Tensor:
    """q `[B, w, V]` of the verified drafts `[B, w]` for rejection sampling: the network's processed probabilities,
    one-hot for fixed (looked-up) drafts."""
    one_hot = torch.nn.functional.one_hot(draft_ids, vocab_size).float()
    if draft_probs is None:
        return one_hot
    width = draft_ids.shape[1]
    return torch.where((sources[:, :width] == LOOKUP)[..., None], one_hot, draft_probs[:, :width])


def make_schedule(speculation: SpeculationConfig, num_draft_tokens: int, profile: StepCostModel | None,
                  expected_accepted: list[float] | None) -> Schedule:
    """The schedule object of `speculation.schedule`, on the step costs `profile` (goodput; None: learnt)."""
    if speculation.schedule == "fixed":
        return FixedSchedule(num_draft_tokens, speculation.confidence_threshold)
    if profile is None and not speculation.cost_feedback:
        raise ValueError("cost_feedback=False needs step costs: pass `step_costs=` (none are cached for this setup).")
    return GoodputSchedule(profile, num_draft_tokens, expected_accepted, packed=speculation.packed_verification,
                           feedback=speculation.cost_feedback)


def make_estimator(acceptance_table: dict | AcceptanceTable | None, companion, num_slots: int,
                   device: torch.device) -> AcceptanceEstimator:
    """An estimator on `device` from the table given (a saved dict or a table), else from an uncalibrated one for the
    signal available."""
    if isinstance(acceptance_table, AcceptanceTable):
        return AcceptanceEstimator(acceptance_table, device)
    if acceptance_table is not None:
        return AcceptanceEstimator(AcceptanceTable.from_dict(acceptance_table), device)
    signal = "sv" if companion is not None else "confidence"
    edges = [uniform_edges(DEFAULT_NUM_BINS)] * SIGNALS[signal]
    return AcceptanceEstimator(AcceptanceTable(signal, edges, num_slots), device)


def _companion_probs(companion, source_states: torch.Tensor, last_committed, draft_ids) -> torch.Tensor:
    """P_c `[B, k, V]` at the drafted positions: the companion reads the target's last hidden state at each row's
    last accepted input `[B, d]` and the chain (committed token, d_1 .. d_{k-1}) `[B, k]`."""
    chain = torch.cat([last_committed[:, None], draft_ids[:, :-1]], dim=1)
    return companion(hidden_states=source_states, input_ids=chain).logits.float().softmax(-1)


def plan_step(batch: RaggedBatch, processor: RaggedLogitsProcessor, proposal: Proposal | None,
              selector: TokenSelector, scheduler: Schedule, estimator: AcceptanceEstimator | None, companion,
              source_states, last_committed, reads: HostReads):
    """This step's drafts and how many of them each row verifies, chosen on the host after one read (`reads`) of
    the estimates (none without drafts, or for a fixed schedule without a threshold).

    Returns draft ids `[B, k]` (`[B, 0]` without drafts), their sources `[B, k]`, the processed probabilities of the
    network's drafts `[B, k, V]` (None when it did not draft, or when neither sampling nor the schedule reads them),
    drafts verified per row `[B]` on the host (finished rows' counts are masked on the device) and the estimated
    chance that drafts 1..j are all accepted `[B, k]` (None without an estimator)."""
    if proposal is None or proposal.empty:  # nothing proposed: a plain decoding step
        none = torch.zeros(batch.size, 0, dtype=torch.long, device=last_committed.device)
        return none, none, None, torch.zeros(batch.size, dtype=torch.long), None
    needs_probs = selector.rejection_sampling or estimator is not None or scheduler.needs_confidence
    draft_ids, sources, draft_probs = draft_tokens(batch, processor, proposal, selector, needs_probs)
    if estimator is None:
        if scheduler.needs_confidence:
            confidence = draft_features("confidence", draft_probs, draft_ids, sources, sampled=selector.do_sample,
                                        fixed_confidence=proposal.confidence)[..., 0]
            scores = reads(confidence.masked_fill(batch.finished[:, None], 0.0))
        else:  # every row verifies k: nothing to read
            scores = torch.ones(draft_ids.shape)
        return draft_ids, sources, draft_probs, scheduler.choose(scores, proposal.drafted), None
    companion_probs = (
        _companion_probs(companion, source_states, last_committed, draft_ids) if estimator.signal == "sv" else None
    )
    predicted = estimator.estimate(draft_probs, draft_ids, sources, companion_probs, selector.do_sample,
                                   proposal.confidence)
    predicted = predicted.masked_fill(batch.finished[:, None], 0.0)  # the scheduler spends nothing on padding
    return draft_ids, sources, draft_probs, scheduler.choose(reads(predicted), proposal.drafted), predicted
