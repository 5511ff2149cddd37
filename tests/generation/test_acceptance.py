"""Acceptance estimates: binned tables (prior, online counts, saving), SV's signals, the estimator."""

from __future__ import annotations

import pytest
import torch

from hf_specformer.generation.acceptance import (
    DRAFTER,
    LOOKUP,
    NO_DRAFT,
    SIGNALS,
    AcceptanceEstimator,
    AcceptanceTable,
    draft_confidence,
    draft_features,
    observed_outcomes,
    sv_features,
    uniform_edges,
)


def test_uncalibrated_table_estimates_the_signal_itself_and_learns_online():
    table = AcceptanceTable("confidence", [uniform_edges(10)], num_slots=2)
    features = torch.tensor([[0.05], [0.55], [0.97]])
    sources, slots = torch.full((3,), DRAFTER), torch.zeros(3, dtype=torch.long)
    assert table.estimate(features, sources, slots).tolist() == pytest.approx([0.05, 0.55, 0.95])
    for _ in range(50):  # drafts of confidence 0.97 turn out to be rejected
        table.add(features[2:], sources[2:], slots[2:], torch.tensor([False]))
    assert float(table.estimate(features[2:], sources[2:], slots[2:])) < 0.1
    assert table.estimate(features[2:], sources[2:], slots[2:] + 1).item() == pytest.approx(0.95)  # other slot
    assert table.estimate(features[2:], torch.tensor([LOOKUP]), slots[2:]).item() == pytest.approx(0.95)


def test_sv_features_are_overlap_and_capped_ratio():
    draft = torch.tensor([[[0.7, 0.2, 0.1]], [[0.0, 1.0, 0.0]]])  # [B=2, k=1, V=3]
    companion = torch.tensor([[[0.35, 0.6, 0.05]], [[0.3, 0.4, 0.3]]])
    drafts = torch.tensor([[0], [1]])
    features = sv_features(draft, companion, drafts)
    assert features[0, 0].tolist() == pytest.approx([0.35 + 0.2 + 0.05, 0.5])
    assert features[1, 0].tolist() == pytest.approx([0.4, 0.4])


def test_signals_of_sampled_drafts_read_the_draft_distribution_not_the_token():
    """Under sampling, the choice of drafts to verify may not depend on the sampled token (it would bias the output,
    `draft_confidence`): every token of a row gives the same signals, their expectation over the draft."""
    draft = torch.tensor([[[0.7, 0.2, 0.1]]]).expand(3, 1, 3)
    companion = torch.tensor([[[0.35, 0.6, 0.05]]]).expand(3, 1, 3)
    tokens = torch.tensor([[0], [1], [2]])
    assert draft_confidence(draft, tokens, sampled=True).flatten().tolist() == pytest.approx([0.54] * 3)
    assert draft_confidence(draft, tokens).flatten().tolist() == pytest.approx([0.7, 0.2, 0.1])
    sampled = sv_features(draft, companion, tokens, sampled=True)
    assert sampled.flatten().tolist() == pytest.approx([0.6] * 6)
    expected_ratio = (draft[0, 0] * (companion[0, 0] / draft[0, 0]).clamp(max=1)).sum()
    assert float(expected_ratio) == pytest.approx(0.6)  # E_d min(1, P_c / P_d) = S


def test_observed_outcomes_follow_verification():
    observed, accepted = observed_outcomes(torch.tensor([0, 2, 3, 1]), torch.tensor([3, 3, 3, 0]), 3)
    assert observed.tolist() == [[True, False, False], [True, True, True], [True, True, True],
                                 [False, False, False]]
    assert accepted.tolist() == [[False, False, False], [True, True, False], [True, True, True],
                                 [True, False, False]]


def test_estimator_gives_cumulative_estimates_zero_without_drafts_and_counts_what_it_observes():
    estimator = AcceptanceEstimator(AcceptanceTable("confidence", [uniform_edges(10)], num_slots=3), "cpu")
    probs = torch.zeros(2, 3, 5)
    probs[..., 1] = 0.85
    probs[..., 2] = 0.15
    drafts = torch.ones(2, 3, dtype=torch.long)
    sources = torch.tensor([[DRAFTER, DRAFTER, LOOKUP], [DRAFTER, NO_DRAFT, NO_DRAFT]])
    cumulative, features = estimator.estimate(probs, drafts, sources)
    # a looked-up draft is one-hot: confidence 1, whatever the network's distribution there (the top bin's 0.95)
    assert cumulative[0].tolist() == pytest.approx([0.85, 0.85**2, 0.85**2 * 0.95])
    assert cumulative[1].tolist() == pytest.approx([0.85, 0.0, 0.0])
    estimator.observe(features, sources, num_accepted=torch.tensor([1, 0]), num_drafts=torch.tensor([3, 1]))
    assert float(estimator.table.trials.sum()) == 3  # row 0: slots 1 (accepted) and 2 (rejected); row 1: slot 1
    assert float(estimator.table.accepted.sum()) == 1


def test_looked_up_drafts_need_no_distribution_and_score_as_one_hot():
    """Lookup-only steps build nothing over the vocabulary: their features equal those of one-hot distributions."""
    drafts = torch.tensor([[3, 1], [0, 2]])
    sources = torch.tensor([[LOOKUP, LOOKUP], [LOOKUP, NO_DRAFT]])
    one_hot = torch.nn.functional.one_hot(drafts, 5).float()
    companion = torch.softmax(torch.randn(2, 2, 5, generator=torch.Generator().manual_seed(0)), -1)
    for signal, kwargs in (("confidence", {}), ("sv", {"companion_probs": companion})):
        without = draft_features(signal, None, drafts, sources, **kwargs)
        with_one_hot = draft_features(signal, one_hot, drafts, sources, **kwargs)
        assert without.shape == (2, 2, SIGNALS[signal])
        torch.testing.assert_close(without[sources == LOOKUP], with_one_hot[sources == LOOKUP])
    expected = companion.gather(2, drafts[..., None])
    torch.testing.assert_close(draft_features("sv", None, drafts, sources, companion)[0], expected[0].expand(2, 2))
