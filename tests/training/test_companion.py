"""Companion training (self-distillation of chains) and acceptance calibration, on tiny random targets."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import make_companion, make_drafter, make_target
from datasets import Dataset
from training_helpers import (  # single_thread: the autouse fixture of the training tests
    learnable_target,
    make_config,
    random_dataset,
    repetitive_dataset,
    single_thread,  # noqa: F401
)
from transformers import AutoModel

from hf_specformer.generation.acceptance import DRAFTER, PRIOR_TRIALS, AcceptanceTable
from hf_specformer.training.calibrate import (
    auc,
    compare_estimators,
    draft_records,
    fit_table,
    fit_tables,
    scores,
    write_table,
)
from hf_specformer.training.target_states import reply_positions
from hf_specformer.training.train_companion import (
    IGNORE,
    CompanionTrainingConfig,
    chain_examples,
    label_index_of,
    train_companion,
)
from hf_specformer.training.train_drafter import train


def small_config(tmp_path, **overrides) -> CompanionTrainingConfig:
    values = dict(data="unused", output=str(tmp_path / "companion"), companion_size=32, num_attention_heads=2,
                  intermediate_size=64, chain_length=3, steps=60, batch_size=64, learning_rate=1e-2, eval_fraction=0.2,
                  save_every=1000)
    return CompanionTrainingConfig(**{**values, **overrides})


def test_chain_examples_are_teacher_forced_reply_continuations():
    target = learnable_target()
    dataset = repetitive_dataset(num_rows=2, response_length=6)
    data = chain_examples(target, dataset, 3, 64, torch.arange(target.config.vocab_size), progress=False)
    row = dataset[0]["input_ids"]
    prompt_length = dataset[0]["prompt_length"]
    # first example: state at the last prompt position; chain = the 3 tokens after it, labels the 3 after those
    assert data.chains[0].tolist() == row[prompt_length: prompt_length + 3]
    assert data.labels[0].tolist() == row[prompt_length + 1: prompt_length + 4]
    assert (data.labels == IGNORE).any()  # past the end of a sequence
    assert data.states.shape == (len(data), target.config.hidden_size)


def test_training_learns_the_continuation_and_saves_a_loadable_companion(tmp_path):
    target = learnable_target()
    evaluation = train_companion(small_config(tmp_path), target=target, dataset=repetitive_dataset(num_rows=24),
                                 progress=False)
    assert evaluation["cross_entropy"] < 0.5 * math.log(target.config.vocab_size), evaluation
    assert min(evaluation["accuracy_by_position"]) > 0.8, evaluation
    saved = json.loads((tmp_path / "companion" / "companion_eval.json").read_text())
    assert saved["steps"] == 60
    loaded = AutoModel.from_pretrained(tmp_path / "companion", trust_remote_code=True, dtype=torch.float64)
    assert loaded.config.model_type == "sv_companion"


def test_label_index_maps_the_companion_vocabulary(target):
    companion = make_companion(target).set_vocab([7, 3, 50])
    index = label_index_of(companion, target.config.vocab_size)
    assert index[[7, 3, 50]].tolist() == [0, 1, 2] and int((index == IGNORE).sum()) == target.config.vocab_size - 3


def test_resume_continues_from_the_last_checkpoint(tmp_path):
    target = learnable_target()
    dataset = repetitive_dataset(num_rows=24)
    train_companion(small_config(tmp_path, steps=20, save_every=10), target=target, dataset=dataset, progress=False)
    resumed = train_companion(small_config(tmp_path, steps=30, save_every=10, resume=True), target=target,
                              dataset=dataset, progress=False)
    assert resumed["steps"] == 30


# ----- calibration ----------------------------------------------------------------------------------------------
def test_fitted_table_matches_rates_per_bin_and_round_trips_as_a_capped_prior():
    generator = torch.Generator().manual_seed(0)
    confidence = torch.rand(20_000, 1, generator=generator)
    accepted = torch.rand(20_000, generator=generator) < confidence[:, 0] ** 2  # calibrated rate: q^2
    sources, slots = torch.full((20_000,), DRAFTER), torch.zeros(20_000, dtype=torch.long)
    table = fit_table("confidence", confidence, sources, slots, accepted, num_bins=10)
    probe = torch.tensor([[0.15], [0.55], [0.95]])  # bin centres (equal-mass bins of a uniform signal: width 0.1)
    estimates = table.estimate(probe, sources[:3], slots[:3])
    assert estimates.tolist() == pytest.approx([q**2 + 0.1**2 / 12 for q in (0.15, 0.55, 0.95)], abs=0.03)
    assert table.expected_accepted == pytest.approx([0.0, float(accepted.double().mean())])
    loaded = AcceptanceTable.from_dict(table.to_dict())
    assert torch.allclose(loaded.estimate(probe, sources[:3], slots[:3]), estimates, atol=1e-6)
    assert float(loaded.prior_trials.max()) == PRIOR_TRIALS  # online counts can move it
    assert loaded.expected_accepted == table.expected_accepted


def test_auc_of_known_rankings():
    labels = torch.tensor([0, 0, 1, 1])
    assert auc(torch.tensor([0.1, 0.2, 0.3, 0.4]), labels) == 1.0
    assert auc(torch.tensor([0.4, 0.3, 0.2, 0.1]), labels) == 0.0
    assert auc(torch.tensor([0.5, 0.5, 0.5, 0.5]), labels) == 0.5
    assert auc(torch.tensor([0.1, 0.3, 0.3, 0.4]), labels) == 0.875


def test_scores_of_a_perfect_and_a_base_rate_estimator():
    labels = torch.tensor([1.0, 0.0] * 50)
    perfect = scores(labels, labels, base_rate=0.5)
    assert perfect["auc"] == 1.0 and perfect["brier"] < 1e-6 and perfect["information_gain_bits"] > 0.99
    constant = scores(torch.full((100,), 0.5), labels, base_rate=0.5)
    assert constant["information_gain_bits"] == pytest.approx(0.0, abs=1e-9) and constant["auc"] == 0.5


def test_calibration_records_labels_and_writes_tables(tmp_path, target_kind):
    """Labels are SD's: a draft counts when every draft before it matched the reply; a trained-on-nothing drafter
    on a predictable reply still yields rows of every kind; the tables land in the folders' config.json."""
    target = make_target(target_kind)
    target.lm_head.weight.mul_(25)  # a sharp target, as `learnable_target`
    drafter, companion = make_drafter(target, draft_length=4), make_companion(target)
    records = draft_records(target, drafter, companion, repetitive_dataset(num_rows=6), 3, progress=False)
    observed, accepted = records["observed"], records["accepted"]
    assert observed[:, 0].all()
    assert (observed[:, 1:] <= (observed[:, :-1] & accepted[:, :-1])).all()  # observed only after an acceptance
    assert ((records["S"] >= 0) & (records["S"] <= 1 + 1e-6)).all() and (records["A"] <= 1).all()
    report = compare_estimators(records, 3)
    for name in ("confidence_table", "sv_table"):
        assert 0 <= report[name]["brier"] <= 1 and -1 < report[name]["information_gain_bits"] <= 1
    tables = fit_tables(records, 3)
    drafter.save_pretrained(tmp_path / "drafter")
    write_table(tmp_path / "drafter", tables["confidence"])
    saved = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert saved["acceptance_table"]["signal"] == "confidence" and saved["acceptance_table"]["num_slots"] == 3


def test_estimators_separate_predictable_from_random_replies(tmp_path):
    """On a mix of predictable (cycling) and random replies a drafter trained on the cycle is confident and right
    on one and unsure and wrong on the other: the drafter's confidence, raw and tabled, ranks well above chance."""
    target = learnable_target()
    result = train(make_config(tmp_path / "run", max_steps=40), target=target, dataset=repetitive_dataset())
    mixed = [*repetitive_dataset(num_rows=8, seed=3), *random_dataset(num_rows=8, seed=4)]
    records = draft_records(target, result.drafter, None, Dataset.from_list(mixed), 3, progress=False)
    report = compare_estimators(records, 3)
    assert report["confidence_table"]["auc"] > 0.8 and report["raw_confidence"]["auc"] > 0.8, report
    assert "sv_table" not in report


def test_a_sequence_cut_inside_its_prompt_has_no_reply_positions():
    """`--max-length` below a long prompt leaves no reply: no positions (the row is skipped), not an error."""
    assert reply_positions(torch.arange(10), 4).tolist() == [3, 4, 5, 6, 7]
    assert reply_positions(torch.arange(10), 12).numel() == 0
