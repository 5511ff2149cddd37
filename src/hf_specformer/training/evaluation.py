"""Held-out evaluation of a drafter: teacher-forced accepted length kappa(k) and per-slot accuracy."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from transformers import PreTrainedModel

from hf_specformer.generation.proposers import ngram_lookup
from hf_specformer.models.specformer import SpecFormerForDrafting
from hf_specformer.training.target_states import next_token_ids, target_hidden_states

CONFIDENCE_EDGES = (0.5, 0.8, 0.95)
"""Bin edges of the target's probability of slot 1's label, for `evaluate_kappa`'s `slot1_by_target_confidence`."""

BEST_OF_LOOKUP = "kappa_best_of_lookup"
"""`evaluate_kappa`'s key for kappa when each step takes the better of the drafter's and prompt lookup's drafts."""


def acceptance_steps(drafts: torch.Tensor, tokens: torch.Tensor, start: int, k: int) -> list[int]:
    """Teacher-forced steps of one sequence `tokens` `[L]` with k drafts per step (`drafts[r]`: those at `start + r`;
    official `validate.py`): each step is 1 + the matched draft prefix."""
    return tree_acceptance_steps(drafts[:, :k, None], tokens, start, [(0,) * k])


def tree_acceptance_steps(ranked: torch.Tensor, tokens: torch.Tensor, start: int,
                          branches: Sequence[Sequence[int]]) -> list[int]:
    """Teacher-forced steps verifying a draft tree: `ranked[r]` `[max_k, R]` the R best tokens of each slot at
    `start + r`; a branch (one rank per slot) drafts `ranked[r, j, branch[j]]`; a step takes the longest match."""
    k = max(len(branch) for branch in branches)
    no_token = ranked.shape[2]  # a branch shorter than k drafts nothing past its end: a rank that never matches
    ranked = torch.cat([ranked[:, :k], ranked.new_full((*ranked.shape[:1], k, 1), -1)], dim=2)
    ranks = torch.tensor([list(branch) + [no_token] * (k - len(branch)) for branch in branches],
                         device=ranked.device)  # [N, k]
    slots = torch.arange(k, device=ranked.device)
    steps, position, length = [], start, tokens.shape[0]
    while position + 1 + k < length:
        candidates = ranked[position - start][slots, ranks]  # [N, k]
        matches = candidates == tokens[position + 2 : position + 2 + k]
        step = 1 + int(matches.long().cumprod(1).sum(1).max())
        steps.append(step)
        position += step
    return steps


def lookup_candidates(tokens: torch.Tensor, start: int, count: int, k: int,
                      ngram_sizes: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prompt lookup's drafts (the engine's `ngram_lookup`) at positions start .. start + count - 1 of `tokens` `[L]`,
    one n-gram size at a time: (ids `[count, k]`, found `[count, k]`)."""
    prefix = torch.arange(start + 2, start + 2 + count, device=tokens.device)
    rows = tokens[None].expand(count, -1)
    return [ngram_lookup(rows, prefix, k, n, n)[:2] for n in ngram_sizes]


def best_of_lookup_steps(drafts: torch.Tensor, tokens: torch.Tensor, start: int, k: int,
                         ngram_sizes: Sequence[int]) -> list[int]:
    """Teacher-forced steps (as `acceptance_steps`) each taking whichever accepts most, the drafter's drafts or prompt
    lookup's: what a perfect choice of source would give, against the rule that chooses at run time."""
    drafts = drafts[:, :k]
    chains = [drafts] + [torch.where(found, ids, drafts)
                         for ids, found in lookup_candidates(tokens, start, drafts.shape[0], k, ngram_sizes)]
    return tree_acceptance_steps(torch.stack(chains, dim=2), tokens, start, [(chain,) * k for chain in
                                                                              range(len(chains))])


@torch.no_grad()
def draft_tokens(target: PreTrainedModel, drafter: SpecFormerForDrafting, input_ids: torch.Tensor, start: int,
                 max_k: int, chunk_size: int = 64, ranks: int | None = None,
                 hidden_states: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """Argmax drafts `[L - 2 - start, max_k]` of one sequence `[L]` (with `ranks`: each slot's best tokens, `[...,
    ranks]`), `chunk_size` positions at a time; `hidden_states`: the target's, where the caller has them."""
    ids = input_ids[None]
    if hidden_states is None:
        hidden_states = target_hidden_states(target, ids, torch.ones_like(ids))
    hooked = drafter.select_hooked_states(hidden_states)
    positions = torch.arange(start, ids.shape[1] - 2, device=ids.device)
    following = next_token_ids(ids)

    def best(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1) if ranks is None else logits.topk(ranks, dim=-1).indices

    chunks = [
        best(drafter(hooked, use_cache=False, draft_positions=chunk[None], num_draft_tokens=max_k,
                     next_token_ids=following).logits[0])
        for chunk in positions.split(chunk_size)
    ]
    empty = (0, max_k) if ranks is None else (0, max_k, ranks)
    return torch.cat(chunks) if chunks else torch.zeros(empty, dtype=torch.long, device=ids.device)


def label_probabilities(target: PreTrainedModel, hidden_states: tuple[torch.Tensor, ...], tokens: torch.Tensor,
                        start: int, count: int) -> torch.Tensor:
    """`[count]`: the target's probability of x_{t+2} at position t + 1, for t = start .. start + count - 1 (how sure
    the target itself is of slot 1's label once it has read x_{t+1}); from its last hidden state `[1, L, d]`."""
    positions = torch.arange(start + 1, start + 1 + count, device=tokens.device)
    logits = target.get_output_embeddings()(hidden_states[-1][0, positions]).float()  # [count, V]
    return logits.softmax(-1).gather(1, tokens[positions + 1, None])[:, 0]


def confidence_bins(hits: torch.Tensor, confidence: torch.Tensor, edges: Sequence[float] = CONFIDENCE_EDGES) -> list:
    """Slot-1 top-1 accuracy per bin of the target's own probability of the label: `[{"low", "high", "share",
    "accuracy"}]` (within a bin, texts differ in what the drafter learnt, not in how predictable they are)."""
    bounds = [0.0, *edges, 1.0]
    rows = []
    for low, high in zip(bounds, bounds[1:]):
        inside = (confidence >= low) & ((confidence < high) | (high == 1.0))
        count = int(inside.sum())
        rows.append({"low": low, "high": high, "share": count / max(len(hits), 1),
                     "accuracy": float(hits[inside].double().mean()) if count else None})
    return rows


@torch.no_grad()
def evaluate_kappa(target: PreTrainedModel, drafter: SpecFormerForDrafting, dataset: Iterable[dict], max_k: int,
                   lookup_ngram_sizes: Sequence[int] = ()) -> dict:
    """Teacher-forced accepted length kappa(k) = tokens / steps for k = 1..max_k on held-out sequences (`input_ids`,
    `prompt_length`), with per-slot top-1 accuracy and acceptance, slot 1 by the target's confidence, the draft
    vocabulary's coverage, and with `lookup_ngram_sizes` `BEST_OF_LOOKUP` (`best_of_lookup_steps`)."""
    was_training = drafter.training
    drafter.eval()
    device = next(drafter.parameters()).device
    steps = [[] for _ in range(max_k)]
    bound_steps = []
    hits, counts = torch.zeros(max_k), torch.zeros(max_k)
    first_hits, confidences, covered = [], [], []
    num_sequences = num_positions = 0
    for row in dataset:
        tokens = torch.tensor(row["input_ids"], dtype=torch.long, device=device)
        start = max(int(row["prompt_length"]) - 1, 0)
        hidden_states = target_hidden_states(target, tokens[None], torch.ones_like(tokens[None]))
        drafts = draft_tokens(target, drafter, tokens, start, max_k, hidden_states=hidden_states)
        if drafts.shape[0] == 0:
            continue
        for k in range(1, max_k + 1):
            steps[k - 1].extend(acceptance_steps(drafts, tokens, start, k))
        if lookup_ngram_sizes:
            bound_steps.extend(best_of_lookup_steps(drafts, tokens, start, max_k, lookup_ngram_sizes))
        labels = [tokens[start + 2 + slot :] for slot in range(max_k)]  # slot j at start + r: x_{start + r + 2 + j}
        matches = [drafts[: len(label), slot] == label for slot, label in enumerate(labels)]  # empty past the end
        hits += torch.tensor([float(match.sum()) for match in matches])
        counts += torch.tensor([float(match.numel()) for match in matches])
        first_hits.append(matches[0].cpu())
        confidences.append(label_probabilities(target, hidden_states, tokens, start, drafts.shape[0]).cpu())
        vocabulary = drafter.draft_vocab_ids
        covered.append(torch.ones_like(first_hits[-1]) if vocabulary is None
                       else torch.isin(labels[0], vocabulary).cpu())
        num_sequences += 1
        num_positions += drafts.shape[0]
    drafter.train(was_training)
    walk = torch.tensor(steps[-1], dtype=torch.float64)
    first_hits, confidences, covered = (torch.cat(values) if values else torch.zeros(0)
                                        for values in (first_hits, confidences, covered))
    report = {
        "kappa": [sum(s) / len(s) if s else None for s in steps],
        "slot_accuracy": (hits / counts.clamp(min=1)).tolist(),
        "slot_acceptance": [float((walk >= slot + 2).double().mean()) if len(walk) else None
                            for slot in range(max_k)],
        "slot1_by_target_confidence": confidence_bins(first_hits, confidences),
        "draft_vocab_coverage": float(covered.double().mean()) if len(covered) else None,
        "mean_target_confidence": float(confidences.double().mean()) if len(confidences) else None,
        "num_steps": len(walk),
        "num_sequences": num_sequences,
        "num_positions": num_positions,
    }
    if lookup_ngram_sizes:
        report[BEST_OF_LOOKUP] = sum(bound_steps) / len(bound_steps) if bound_steps else None
    return report
