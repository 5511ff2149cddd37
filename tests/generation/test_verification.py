"""Acceptance math: exact greedy cases from one-hot scores, and rejection sampling's output distribution."""

from __future__ import annotations

import pytest
import torch

from hf_specformer.generation.verification import EMPTY_SLOT, greedy_tokens, verify_greedy, verify_sampling

V = 8


def one_hot_scores(tokens: list[list[int]]) -> torch.Tensor:
    """`[B, n]` target argmax tokens -> `[B, n, V]` scores."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_greedy_tokens_are_argmax_with_its_ties_and_nans(dtype):
    scores = torch.randint(0, 3, (16, 5, 1031), generator=torch.Generator().manual_seed(0)).to(dtype)  # many ties
    scores[0, 0, [5, 9]] = float("nan")
    scores[1] = float("-inf")
    assert torch.equal(greedy_tokens(scores), scores.argmax(-1))


def test_greedy_all_match_gives_bonus():
    tokens, accepted = verify_greedy(torch.tensor([[1, 2, 3]]), one_hot_scores([[1, 2, 3, 4]]))
    assert accepted.tolist() == [3] and tokens.tolist() == [[1, 2, 3, 4]]


def test_greedy_early_mismatch_gives_correction():
    tokens, accepted = verify_greedy(torch.tensor([[1, 5, 3]]), one_hot_scores([[1, 2, 3, 4]]))
    assert accepted.tolist() == [1] and tokens.tolist() == [[1, 2, EMPTY_SLOT, EMPTY_SLOT]]


def test_greedy_ragged_rows():
    drafts = torch.tensor([[7, 2], [1, 2], [1, 6]])
    tokens, accepted = verify_greedy(drafts, one_hot_scores([[1, 2, 3], [1, 2, 3], [1, 2, 3]]))
    assert accepted.tolist() == [0, 2, 1]
    assert tokens.tolist() == [[1, EMPTY_SLOT, EMPTY_SLOT], [1, 2, 3], [1, 2, EMPTY_SLOT]]


def test_greedy_match_after_mismatch_is_not_accepted():
    tokens, accepted = verify_greedy(torch.tensor([[0, 2, 3]]), one_hot_scores([[1, 2, 3, 4]]))
    assert accepted.tolist() == [0] and tokens[0, 0] == 1


def test_sampling_accepts_when_draft_equals_target():
    p = torch.softmax(torch.randn(2, 4, V), -1)
    drafts = torch.multinomial(p[:, :3].reshape(-1, V), 1).view(2, 3)
    tokens, accepted = verify_sampling(drafts, p[:, :3], p)
    assert accepted.tolist() == [3, 3] and torch.equal(tokens[:, :3], drafts)


def test_sampling_rejects_zero_target_probability():
    p = torch.zeros(1, 2, V)
    p[0, :, 4] = 1.0
    q = torch.full((1, 1, V), 1.0 / V)
    tokens, accepted = verify_sampling(torch.tensor([[3]]), q, p)
    assert accepted.tolist() == [0] and tokens.tolist() == [[4, EMPTY_SLOT]]


def test_sampling_first_token_follows_target_distribution():
    """One drafted position, many rows: the committed first token is distributed as p, not q (TV < 0.01)."""
    generator = torch.Generator().manual_seed(0)
    n = 200_000
    p1 = torch.softmax(torch.randn(V, generator=generator) * 2, -1)
    q1 = torch.softmax(torch.randn(V, generator=generator) * 2, -1)
    drafts = torch.multinomial(q1, n, replacement=True, generator=generator)[:, None]
    p = torch.stack([p1, p1])[None].expand(n, -1, -1)
    q = q1[None, None].expand(n, 1, -1)
    tokens, _ = verify_sampling(drafts, q, p, generator=generator)
    empirical = torch.bincount(tokens[:, 0], minlength=V).float() / n
    assert 0.5 * (empirical - p1).abs().sum() < 0.01  # sampling noise is ~0.003 at this n
    assert 0.5 * (empirical - q1).abs().sum() > 0.1  # and the check can tell p from q


def test_greedy_stops_at_each_rows_verified_drafts():
    """Row 0 verifies 1 of 3 matching drafts: the target's own token follows it. Row 1 verifies 2 but rejects the
    first. Row 2 verifies all 3."""
    drafts = torch.tensor([[1, 2, 3], [5, 2, 3], [1, 2, 3]])
    tokens, accepted = verify_greedy(drafts, one_hot_scores([[1, 2, 3, 4]] * 3), torch.tensor([1, 2, 3]))
    assert accepted.tolist() == [1, 0, 3]
    assert tokens.tolist() == [[1, 2, EMPTY_SLOT, EMPTY_SLOT], [1, EMPTY_SLOT, EMPTY_SLOT, EMPTY_SLOT], [1, 2, 3, 4]]


def test_sampling_token_after_the_verified_drafts_follows_target():
    """Drafts drawn from q = p would all be accepted; with one verified draft, the next token is a sample of p at
    that position (the bonus distribution), not of the residual p - q (which is zero)."""
    generator = torch.Generator().manual_seed(1)
    n = 100_000
    p_row = torch.softmax(torch.randn(3, V, generator=generator) * 2, -1)
    p = p_row[None].expand(n, -1, -1)
    drafts = torch.stack([torch.multinomial(p_row[j], n, replacement=True, generator=generator) for j in range(2)], 1)
    tokens, accepted = verify_sampling(drafts, p[:, :2], p, torch.ones(n, dtype=torch.long), generator=generator)
    assert accepted.eq(1).all() and tokens[:, 2].eq(EMPTY_SLOT).all()
    empirical = torch.bincount(tokens[:, 1], minlength=V).float() / n
    assert 0.5 * (empirical - p_row[1]).abs().sum() < 0.01
