"""`eval-drafter`: on the same texts, live acceptance (speculative `generate`) equals the teacher-forced walk's within
`MAX_GAP`, for a drafter that gets drafts accepted (self-distilled on a tiny target's own greedy answers), and the
live outputs equal plain `generate`'s."""

from __future__ import annotations

import pytest
import torch
from conftest import make_target
from datasets import Dataset

from hf_specformer.apps.drafter_eval import (
    ALL,
    BEST_OF_LOOKUP,
    LIVE_RUNS,
    MAX_GAP,
    causes_table,
    evaluate_drafter,
    main,
    select,
    table,
)
from hf_specformer.training.config import DrafterTrainingConfig
from hf_specformer.training.train_drafter import train

NEW_TOKENS = 40


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 12, (count,), generator=generator).tolist()
    return [torch.randint(3, 96, (length,), generator=generator).tolist() for length in lengths]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """A tiny Llama (head scaled so that drafts can be sharp) and a drafter trained for 60 steps on its greedy
    answers to 20 random prompts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target = make_target("llama")
    target.lm_head.weight.mul_(25)
    rows = []
    for prompt in _prompts(20, seed=0):
        ids = torch.tensor([prompt])
        answer = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False)
        rows.append({"input_ids": answer[0].tolist(), "prompt_length": len(prompt)})
    config = DrafterTrainingConfig(
        data="unused", output_dir=str(tmp_path_factory.mktemp("run")), target="unused", draft_length=4,
        max_steps=60, per_device_batch_size=4, learning_rate=3e-3, min_learning_rate=1e-4, warmup_ratio=0.1,
        max_length=64, positions_per_sequence=8, eval_fraction=0.1, eval_every=0, save_every=0,
        save_dtype="float32", num_threads=1,
    )
    drafter = train(config, target=target, dataset=Dataset.from_list(rows)).drafter.eval()
    yield target, drafter
    torch.set_num_threads(threads)


def test_live_acceptance_equals_teacher_forced_on_the_same_texts(distilled):
    """On texts the drafter was trained on (so that its drafts are accepted: the comparison then means something)
    and on unseen ones."""
    target, drafter = distilled
    prompts = _prompts(20, seed=0)[:3] + _prompts(3, seed=1)
    report = evaluate_drafter(target, drafter, prompts, ["seen"] * 3 + ["unseen"] * 3, num_draft_tokens=3,
                              max_new_tokens=NEW_TOKENS, eos_token_ids={2}, with_lookup=True, with_suffix=True)
    assert set(report) == {"seen", "unseen", ALL} and report[ALL]["num_prompts"] == 6
    for row in report.values():
        assert row["gap"] <= MAX_GAP, table(report)
        assert all(row[run]["mismatched_rows"] == 0 for run in LIVE_RUNS), table(report)
        assert abs(row["live"]["kappa"] - row["teacher_forced"]["kappa"][-1]) <= 3 * MAX_GAP, table(report)
    assert report["seen"]["live"]["slot_acceptance"][0] > 0.3, table(report)
    assert report[ALL]["live_lookup"]["kappa"] >= report[ALL]["live"]["kappa"]
    # the run-time rule's choice between the drafter and lookup is one of those the per-step best takes
    assert report[ALL]["live_lookup"]["kappa"] <= report[ALL]["teacher_forced"][BEST_OF_LOOKUP] + MAX_GAP
    assert f"{report[ALL]['teacher_forced'][BEST_OF_LOOKUP]:.2f} |" in table(report).splitlines()[-1]


def test_causes_table_splits_slot_one_by_the_targets_confidence(distilled):
    """Where the drafter gets drafts accepted, the confidence bins' accuracies weighted by their shares give slot 1's
    teacher-forced accuracy, and the table has a row per group."""
    target, drafter = distilled
    report = evaluate_drafter(target, drafter, _prompts(20, seed=0)[:3], ["seen"] * 3, num_draft_tokens=3,
                              max_new_tokens=NEW_TOKENS, eos_token_ids={2})
    forced = report[ALL]["teacher_forced"]
    bins = forced["slot1_by_target_confidence"]
    assert forced["slot_accuracy"][0] > 0.3
    assert sum(b["share"] * b["accuracy"] for b in bins if b["share"]) == pytest.approx(forced["slot_accuracy"][0])
    lines = causes_table(report).splitlines()
    assert len(lines) == 4 and lines[2].startswith("| seen | ") and lines[3].startswith(f"| {ALL} | ")


def test_select_keeps_the_first_prompts_of_each_group():
    prompts, groups = select(["p1", "p2", "p3", "p4", "p5"], ["x", "y", "x", "x", "y"], 2)
    assert prompts == ["p1", "p2", "p3", "p5"] and groups == ["x", "y", "x", "y"]


def test_command_rejects_impossible_lengths(tmp_path):
    with pytest.raises(SystemExit, match="max-new-tokens"):
        main(["--num-draft-tokens", "3", "--max-new-tokens", "4", "--output", str(tmp_path / "report")])
    assert not (tmp_path / "report.json").exists()
