"""Tests of drafter training: data loading, labels, intra-batch accumulation, learning, exact resume, evaluation,
and a two-process `accelerate launch` run. Tiny random targets (float64 in process, float32 on disk)."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import make_drafter, make_target
from datasets import Dataset
from peft import PeftModel
from safetensors.torch import load_file
from training_helpers import (  # single_thread: autouse, for every test here
    CYCLE,
    free_port,
    learnable_target,
    make_config,
    random_dataset,
    read_metrics,
    repetitive_dataset,
    single_thread,  # noqa: F401
)

from hf_specformer.models import SpecFormerForDrafting
from hf_specformer.training.data import collate, cut_loops, load_distilled, loop_end, reply_vocabulary
from hf_specformer.training.evaluation import (
    acceptance_steps,
    best_of_lookup_steps,
    confidence_bins,
    draft_tokens,
    evaluate_kappa,
    label_probabilities,
    tree_acceptance_steps,
)
from hf_specformer.training.losses import (
    IGNORE_INDEX,
    draft_vocab_labels,
    intra_batch_backward,
    sample_positions,
    slot_labels,
)
from hf_specformer.training.optimization import build_optimizer
from hf_specformer.training.target_states import (
    TargetStateCache,
    future_states,
    hooked_target_states,
    target_hidden_states,
)
from hf_specformer.training.train_drafter import build_drafter, train


# ----- data and labels -----------------------------------------------------------------------------------------
def test_load_distilled_reads_progress_records_and_saved_datasets(tmp_path):
    progress = tmp_path / "run" / "progress"
    progress.mkdir(parents=True)
    records = [{"id": i, "prompt": "p", "input_ids": [1, 2, 3 + i], "prompt_length": 2, "response": "r"}
               for i in (2, 0, 1)]
    content = "".join(json.dumps(record) + "\n" for record in records) + '{"id": 3, "input_'
    (progress / "records.jsonl").write_text(content)
    dataset = load_distilled(tmp_path / "run")
    assert dataset.column_names == ["input_ids", "prompt_length"]
    assert dataset["input_ids"][:] == [[1, 2, 3], [1, 2, 4], [1, 2, 5]]  # sorted by id, cut line ignored
    assert (progress / "records.jsonl").read_text() == content  # left untouched

    Dataset.from_list(records).save_to_disk(str(tmp_path / "run" / "dataset"))
    assert len(load_distilled(tmp_path / "run")) == 3  # a finished run's dataset wins
    Dataset.from_list(records[:2]).save_to_disk(str(tmp_path / "saved"))
    assert load_distilled(tmp_path / "saved")["prompt_length"][:] == [2, 2]
    with pytest.raises(FileNotFoundError):
        load_distilled(tmp_path / "missing")


def test_config_rejects_inconsistent_values(tmp_path):
    with pytest.raises(ValueError, match="min_learning_rate"):
        make_config(tmp_path, learning_rate=1e-4, min_learning_rate=1e-3)
    with pytest.raises(ValueError, match="eval_fraction"):
        make_config(tmp_path, eval_fraction=1.0)
    with pytest.raises(ValueError, match="epochs"):
        make_config(tmp_path, max_steps=None, epochs=0)
    with pytest.raises(ValueError, match="loss_slots"):
        make_config(tmp_path, draft_length=4, loss_slots=5)
    with pytest.raises(ValueError, match="draft_vocab_loss"):
        make_config(tmp_path, draft_vocab_loss=True)
    with pytest.raises(ValueError, match="eval_data"):
        make_config(tmp_path, eval_data=str(tmp_path / "heldout"))  # beside the default split of `data`
    with pytest.raises(ValueError, match="cut_loops"):
        make_config(tmp_path, cut_loops=1)


def test_labels_are_future_reply_tokens():
    batch = collate({"input_ids": [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8]], "prompt_length": [3, 1]}, max_length=64)
    positions, mask = sample_positions(batch.lengths.tolist(), batch.prompt_lengths.tolist(), 0, random.Random(0))
    assert mask.tolist() == [[True] * 3, [True, True, False]]
    assert sorted(positions[0].tolist()) == [1, 2, 3] and sorted(positions[1, :2].tolist()) == [0, 1]
    positions = torch.tensor([[1, 2, 3], [0, 1, 0]])  # the same positions in order, for readable labels
    labels = slot_labels(batch, positions, mask, num_slots=3)
    x = IGNORE_INDEX
    assert labels.tolist() == [
        [[8, 9, 10], [9, 10, x], [10, x, x]],  # x_{t+2+j} in the reply (index >= 3), nothing past the end
        [[7, 8, x], [8, x, x], [x, x, x]],  # padded position: no labels
    ]
    sampled, sampled_mask = sample_positions([40], [3], 5, random.Random(0))
    assert sampled_mask.all() and sampled.shape == (1, 5) and sampled.min() >= 1 and sampled.max() <= 37
    assert sampled[0].unique().numel() == 5
    every, _ = sample_positions([40], [3], 0, random.Random(0))
    assert sorted(every[0].tolist()) == list(range(1, 38)) and every[0].tolist() != sorted(every[0].tolist())


def test_reply_vocabulary_ranks_reply_tokens_by_frequency():
    dataset = Dataset.from_list([{"input_ids": [1, 2, 9, 9, 7], "prompt_length": 2},
                                 {"input_ids": [2, 7, 9, 5, 4], "prompt_length": 1}])
    assert reply_vocabulary(dataset, 3) == [9, 7, 4]  # 9: 3 uses, 7: 2, then 4 and 5 tie (1 use): lower id first
    assert reply_vocabulary(dataset, 10) == [9, 7, 4, 5]  # prompt-only tokens 1 and 2 never count


def test_loop_end_stops_after_the_first_repeated_window():
    assert loop_end([5, 6, 7, 8, 5, 6, 9, 7], 3) == 8  # 5 6 comes back, but no 3-token window does
    assert loop_end([5, 6, 7, 8, 5, 6, 9, 7], 2) == 6  # the window 5 6 completes its repeat at index 5
    assert loop_end([4, 4, 4, 4], 2) == 3  # 4 4, then 4 4 again
    assert loop_end([1, 2], 3) == 2 and loop_end([], 2) == 0  # shorter than a window: whole
    dataset = Dataset.from_list([{"input_ids": [9, 9, 1, 2, 1, 2, 1], "prompt_length": 2},
                                 {"input_ids": [9, 1, 2, 3], "prompt_length": 1}])
    cut = cut_loops(dataset, 2)  # the prompt's own repeat (9 9) does not count
    assert cut["input_ids"][:] == [[9, 9, 1, 2, 1, 2], [9, 1, 2, 3]] and cut["prompt_length"][:] == [2, 1]


# ----- intra-batch gradient accumulation -----------------------------------------------------------------------
@pytest.mark.parametrize("feature_weight, num_ce_positions, soft_weight", [(0.0, 0, 0.0), (0.5, 3, 0.0), (0.0, 4, 0.7)])
def test_intra_batch_backward_matches_plain_loss(target_kind, feature_weight, num_ce_positions, soft_weight):
    """Against the loss written out with all `[B, P, l_d, V]` logits at once: cross-entropy alone on every position;
    cross-entropy on the first 3 positions plus the feature loss (on all 6) against the target's last hidden state
    at t + 1 + j; and cross-entropy plus the soft-label KL from the target's own distribution at t + 1 + j (its
    logits from a forward of the target, not from the drafter's helpers) on the first 4, written with loops."""
    target = make_target(target_kind)
    drafter = make_drafter(target, draft_length=4).train()
    batch = collate(repetitive_dataset(3)[:3], max_length=64)
    all_states = target_hidden_states(target, batch.input_ids, batch.attention_mask)
    hooked = drafter.select_hooked_states(all_states)
    positions, mask = sample_positions(batch.lengths.tolist(), batch.prompt_lengths.tolist(), 6, random.Random(0))
    labels = slot_labels(batch, positions, mask, num_slots=4)
    features = future_states(all_states[-1], positions, num_slots=4)

    def slot_states():
        return drafter(hooked, attention_mask=batch.attention_mask, use_cache=False, draft_positions=positions,
                       num_draft_tokens=4, return_logits=False).slot_hidden_states

    losses = intra_batch_backward(drafter, slot_states(), labels, feature_targets=features,
                                  feature_weight=feature_weight, num_ce_positions=num_ce_positions,
                                  soft_label_weight=soft_weight)
    intra_grads = {name: parameter.grad.clone() for name, parameter in drafter.named_parameters()}
    drafter.zero_grad()

    states = slot_states()
    logits = drafter.compute_logits(states)  # [B, P, l_d, V] all at once
    ce_logits, ce_labels = logits[:, : num_ce_positions or None], labels[:, : num_ce_positions or None]
    plain_ce = [F.cross_entropy(ce_logits[:, :, j].flatten(0, 1), ce_labels[:, :, j].flatten()) for j in range(4)]
    plain_feature = []
    for j in range(4):
        terms = [F.smooth_l1_loss(drafter.normalize(states[b, p, j]), all_states[-1][b, positions[b, p] + 1 + j],
                                  reduction="sum")
                 for b in range(3) for p in range(positions.shape[1]) if labels[b, p, j] != IGNORE_INDEX]
        plain_feature.append(torch.stack(terms).mean())
    target_logits = target(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, T, V]
    plain_soft = []
    for j in range(4):
        terms = [F.kl_div(ce_logits[b, p, j].log_softmax(-1), target_logits[b, positions[b, p] + 1 + j].log_softmax(-1),
                          log_target=True, reduction="sum")
                 for b in range(3) for p in range(ce_logits.shape[1]) if labels[b, p, j] != IGNORE_INDEX]
        plain_soft.append(torch.stack(terms).mean())
    plain = torch.stack([ce + feature_weight * f + soft_weight * kl
                         for ce, f, kl in zip(plain_ce, plain_feature, plain_soft)]).mean()
    plain.backward()

    assert losses.total == pytest.approx(plain.item(), rel=1e-10)
    assert losses.cross_entropy == pytest.approx([loss.item() for loss in plain_ce], rel=1e-10)
    if feature_weight:
        assert losses.feature == pytest.approx([loss.item() for loss in plain_feature], rel=1e-10)
    if soft_weight:
        assert losses.soft == pytest.approx([loss.item() for loss in plain_soft], rel=1e-9)
        assert min(losses.soft) > 0
    for name, parameter in drafter.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
        assert torch.allclose(intra_grads[name], parameter.grad, rtol=1e-9, atol=1e-12), name
    assert all(p.grad is None for p in target.parameters())



def test_intra_batch_backward_on_the_draft_vocabulary_and_the_first_slots(target_kind):
    """`draft_vocab_loss` against the loss written out: the whole vocabulary's logits cut to the draft vocabulary's
    columns, labels outside it skipped, soft labels from the target's forward cut the same way; on the first 2 of 4
    slots (as `loss_slots` trains them: all 4 attend, 2 continue)."""
    target = make_target(target_kind)
    drafter = make_drafter(target, draft_length=4).train()
    batch = collate(repetitive_dataset(3)[:3], max_length=64)
    hooked = drafter.select_hooked_states(target_hidden_states(target, batch.input_ids, batch.attention_mask))
    positions, mask = sample_positions(batch.lengths.tolist(), batch.prompt_lengths.tolist(), 6, random.Random(0))
    labels = slot_labels(batch, positions, mask, num_slots=2)
    vocab = torch.tensor([CYCLE[3], 40, CYCLE[0], 7, CYCLE[5], CYCLE[1]])  # 4 of CYCLE's 7 reply tokens
    drafter.set_draft_vocab(vocab)
    all_states = target_hidden_states(target, batch.input_ids, batch.attention_mask)
    features = future_states(all_states[-1], positions, num_slots=2)

    def slot_states():
        return drafter(hooked, attention_mask=batch.attention_mask, use_cache=False, draft_positions=positions,
                       num_draft_tokens=2, return_logits=False).slot_hidden_states

    losses = intra_batch_backward(drafter, slot_states(), labels, feature_targets=features, soft_label_weight=0.5,
                                  draft_vocab_loss=True)
    intra_grads = {name: parameter.grad.clone() for name, parameter in drafter.named_parameters()}
    drafter.zero_grad()

    logits = drafter.compute_logits(slot_states())[..., vocab]  # [B, P, l_d, V_d]
    column = {int(token): i for i, token in enumerate(vocab)}
    mapped = labels.clone().apply_(lambda token: column.get(token, IGNORE_INDEX))
    assert (mapped != IGNORE_INDEX).sum() < (labels != IGNORE_INDEX).sum()  # some labels fall outside
    target_logits = target(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[..., vocab]
    plain = []
    for j in range(2):
        ce = F.cross_entropy(logits[:, :, j].flatten(0, 1), mapped[:, :, j].flatten())
        kl = torch.stack([F.kl_div(logits[b, p, j].log_softmax(-1),
                                   target_logits[b, positions[b, p] + 1 + j].log_softmax(-1),
                                   log_target=True, reduction="sum")
                          for b in range(3) for p in range(positions.shape[1]) if mapped[b, p, j] != IGNORE_INDEX])
        plain.append(ce + 0.5 * kl.mean())
    torch.stack(plain).mean().backward()

    assert len(losses.cross_entropy) == 2
    assert losses.total == pytest.approx(torch.stack(plain).mean().item(), rel=1e-9)
    for name, parameter in drafter.named_parameters():
        assert torch.allclose(intra_grads[name], parameter.grad, rtol=1e-9, atol=1e-12), name
    with pytest.raises(ValueError, match="draft vocabulary"):
        draft_vocab_labels(labels, None)

def test_target_state_cache_matches_the_batched_forward(target_kind):
    target = make_target(target_kind)
    drafter = make_drafter(target, draft_length=4)
    batch = collate({"input_ids": [ids[: 40 - 7 * row] for row, ids in enumerate(random_dataset(3)["input_ids"])],
                     "prompt_length": [5, 5, 5]}, max_length=64)  # lengths 40, 33, 26: right padding
    batched = torch.stack(hooked_target_states(target, drafter, batch.input_ids, batch.attention_mask), dim=2)
    last_batched = target_hidden_states(target, batch.input_ids, batch.attention_mask)[-1]
    for keep in (False, True):
        cache = TargetStateCache(target, drafter, keep=keep)
        hooked, last = cache.batch([7, 8, 9], batch)
        assert hooked.shape == batched.shape and last.shape == last_batched.shape
        valid = batch.attention_mask.bool()
        assert torch.allclose(hooked[valid], batched[valid], atol=1e-10)
        assert torch.allclose(last[valid], last_batched[valid], atol=1e-10)
        assert not hooked[~valid].any() and not last[~valid].any()
        assert sorted(cache.memory) == ([7, 8, 9] if keep else [])
    assert cache.sequence(8, batch.input_ids[1, :33])[0] is cache.memory[8][0]  # kept: not recomputed
    positions = torch.tensor([[0, 30], [5, 1], [2, 3]])
    futures = future_states(last, positions, num_slots=2)
    assert torch.equal(futures[0, 1, 1], last[0, 32]) and torch.equal(futures[1, 0, 0], last[1, 6])


# ----- training ------------------------------------------------------------------------------------------------
def test_training_lowers_the_loss_and_exports(tmp_path):
    """Also restricts drafting to the reply vocabulary (the 7 tokens of `CYCLE`) before evaluation and export."""
    output_dir = tmp_path / "run"
    result = train(make_config(output_dir, draft_vocab_size=50), target=learnable_target(),
                   dataset=repetitive_dataset())
    assert sorted(result.drafter.draft_vocab_ids.tolist()) == CYCLE
    exported = json.loads((output_dir / "drafter" / "config.json").read_text())
    assert exported["draft_vocab_size"] == len(CYCLE)
    losses = [record["loss"] for record in read_metrics(output_dir) if "loss" in record]
    assert len(losses) == 30 and result.state.step == 30
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], losses
    assert (output_dir / "drafter" / "config.json").exists()
    assert (output_dir / "drafter" / "custom_generate" / "generate.py").exists()
    evaluation = json.loads((output_dir / "eval.json").read_text())
    assert evaluation["step"] == 30 and len(evaluation["kappa"]) == 4
    assert all(1.0 <= kappa <= k + 1 for k, kappa in enumerate(evaluation["kappa"], start=1))
    assert evaluation["kappa"] == sorted(evaluation["kappa"])  # trained on a predictable reply: grows with k


def test_training_on_the_draft_vocabulary_and_the_first_slots(tmp_path):
    """`draft_vocab_loss` with `draft_vocab_size`: the vocabulary is counted before training and the losses score
    it alone; `loss_slots=2` logs and trains 2 of the 4 slots, and the loss still falls."""
    output_dir = tmp_path / "run"
    result = train(make_config(output_dir, draft_vocab_size=50, draft_vocab_loss=True, loss_slots=2),
                   target=learnable_target(), dataset=repetitive_dataset())
    assert sorted(result.drafter.draft_vocab_ids.tolist()) == CYCLE
    records = [record for record in read_metrics(output_dir) if "loss" in record]
    assert all(len(record["slot_losses"]) == 2 for record in records)
    assert sum(r["loss"] for r in records[-3:]) / 3 < 0.8 * records[0]["loss"]


def test_eval_data_replaces_the_held_out_split(tmp_path, caplog):
    """`eval_data`: every usable row of the training data is trained on, and the kappa is measured on the other
    folder's usable rows, the same ones a run that holds them out of a larger set would measure."""
    heldout = repetitive_dataset(seed=1).select(range(3)).add_item({"input_ids": [1, 2], "prompt_length": 2})
    heldout.save_to_disk(str(tmp_path / "heldout"))  # its last row has no reply: not usable
    with caplog.at_level(logging.INFO, logger="hf_specformer.training.train_drafter"):
        result = train(make_config(tmp_path / "run", eval_data=str(tmp_path / "heldout"), eval_fraction=0.0,
                                   max_steps=2), target=learnable_target(), dataset=repetitive_dataset())
    assert "16 train / 3 held-out sequences" in caplog.text
    assert result.evaluation["num_sequences"] == 3


def test_cut_loops_cuts_the_training_replies_only(tmp_path, caplog):
    """A reply cycling through 7 tokens first repeats a 4-token window at its 11th token: each of the 16 training
    sequences keeps its 3 prompt tokens and 11 of 24 reply tokens, while the held-out replies stay whole (23
    positions each)."""
    repetitive_dataset(seed=1).select(range(3)).save_to_disk(str(tmp_path / "heldout"))
    with caplog.at_level(logging.INFO, logger="hf_specformer.training.train_drafter"):
        result = train(make_config(tmp_path / "run", eval_data=str(tmp_path / "heldout"), eval_fraction=0.0,
                                   cut_loops=4, max_steps=2), target=learnable_target(), dataset=repetitive_dataset())
    assert f"cut_loops=4 keeps {16 * 14} of {16 * 27} training tokens" in caplog.text
    assert result.evaluation["num_positions"] == 3 * 23


def test_init_from_a_plain_drafter_adds_the_next_token_input_at_its_own_learning_rate(tmp_path):
    """Fine-tuning a drafter trained without the next-token input into one with it: the trained weights load, the new
    ones start at zero and are the only ones at `new_parameter_learning_rate_scale` times the learning rate."""
    target = make_target()
    plain = make_drafter(target)
    plain.save_pretrained(tmp_path / "plain")
    config = make_config(tmp_path / "run", init_from=str(tmp_path / "plain"), next_token_input=True,
                         new_parameter_learning_rate_scale=10.0)
    drafter, new_parameters = build_drafter(target, config)
    assert new_parameters == {"context_block.next_token_input.weight", "context_block.next_token_input.norm.weight"}
    assert drafter.context_block.next_token_input.weight.abs().max() == 0
    torch.testing.assert_close(drafter.context_block.down_proj.weight, plain.context_block.down_proj.weight)
    optimizer = build_optimizer(drafter, config, new_parameters)
    names = {id(p): name for name, p in drafter.named_parameters()}
    rates = {names[id(p)]: group["lr"] for group in optimizer.param_groups for p in group["params"]}
    assert len(rates) == len(names)
    assert {name for name, lr in rates.items() if lr == pytest.approx(3e-2)} == new_parameters
    assert {lr for name, lr in rates.items() if name not in new_parameters} == {3e-3}


def test_intermediate_size_sets_a_fresh_drafters_width_only(tmp_path):
    """A fresh drafter takes `intermediate_size` as given; an `init_from` drafter keeps its own (no widening)."""
    target = learnable_target()
    fresh, _ = build_drafter(target, make_config(tmp_path / "fresh", intermediate_size=48))
    assert fresh.config.intermediate_size == 48 and fresh.slot_block.mlp.gate_proj.out_features == 48
    make_drafter(target).save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match="keeps its own"):
        make_config(tmp_path / "run", init_from=str(tmp_path / "base"), intermediate_size=240)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's, on loading
def test_lora_adapts_a_drafter_and_its_adapter_saves_loads_and_merges(tmp_path):
    """`lora`: a drafter (here an untrained one) adapted to new data by LoRA adapters alone. The run reports the
    starting drafter's kappa and beats it; the saved adapter, loaded onto the starting drafter with PEFT and merged,
    gives the exported drafter's weights; the starting weights themselves never changed."""
    target = learnable_target()
    base = make_drafter(target)
    base.save_pretrained(tmp_path / "base")
    config = make_config(tmp_path / "run", init_from=str(tmp_path / "base"), lora=True, lora_rank=8,
                         learning_rate=1e-2, min_learning_rate=1e-3)
    result = train(config, target=target, dataset=repetitive_dataset())
    losses = [record["loss"] for record in read_metrics(tmp_path / "run") if "loss" in record]
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], losses
    evaluation = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert evaluation["kappa"][-1] > evaluation["initial"]["kappa"][-1] + 0.5, evaluation

    fresh = SpecFormerForDrafting.from_pretrained(tmp_path / "base", dtype=torch.float64)
    starting = {name: tensor.clone() for name, tensor in fresh.state_dict().items()}
    adapted = PeftModel.from_pretrained(fresh, tmp_path / "run" / "adapter")
    assert {name for name, p in adapted.named_parameters() if "lora_" in name}  # the adapters load
    merged = adapted.merge_and_unload().state_dict()
    exported = load_file(tmp_path / "run" / "drafter" / "model.safetensors")
    assert exported.keys() == merged.keys()
    for name in exported:
        torch.testing.assert_close(exported[name].double(), merged[name], rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(merged[name], starting[name]) for name in merged)
    torch.testing.assert_close(result.drafter.state_dict()["slot_block.positional_proj.weight"],
                               merged["slot_block.positional_proj.weight"])
    base_weights = load_file(tmp_path / "base" / "model.safetensors")
    assert all(torch.equal(base_weights[name], starting[name].to(base_weights[name].dtype))
               for name in base_weights)


def test_lora_needs_a_drafter_to_adapt(tmp_path):
    with pytest.raises(ValueError, match="init_from"):
        make_config(tmp_path, lora=True)
    with pytest.raises(ValueError, match="next-token input"):
        make_config(tmp_path, lora=True, init_from="x", next_token_input=True)


@pytest.mark.parametrize("interruption", ["crash", "stop_and_extend"])
def test_resumed_run_matches_uninterrupted_run(tmp_path, interruption):
    """`crash`: the 6-step run's last checkpoint is deleted, as if it had died after step 3, and it is resumed.
    `stop_and_extend`: a 3-step run is resumed with max_steps=6 (constant learning rate, so that the schedule,
    which depends on max_steps, is the same). Either way the result equals the uninterrupted 6-step run. The crash
    case also runs the feature loss, cross-entropy on a subset and the in-memory target states, which the resumed
    run computes afresh while the uninterrupted one reuses them; the other case trains a drafter that reads the next
    token (`next_token_input`)."""
    dataset = repetitive_dataset(num_rows=6)  # 5 train rows -> 3 micro-batches of 2 per epoch, windows of 2
    schedule = {"feature_loss_weight": 0.5, "ce_positions_per_sequence": 2, "cache_target_states": True} \
        if interruption == "crash" else {"warmup_ratio": 0.0, "min_learning_rate": 3e-3, "next_token_input": True}
    options = dict(max_steps=6, per_device_batch_size=2, gradient_accumulation_steps=2, save_every=3,
                   positions_per_sequence=4, **schedule)
    reference = train(make_config(tmp_path / "reference", **options), target=make_target(), dataset=dataset)

    run_dir = tmp_path / "interrupted"
    if interruption == "crash":
        train(make_config(run_dir, **options), target=make_target(), dataset=dataset)
        shutil.rmtree(run_dir / "checkpoints" / "step-6")
    else:
        train(make_config(run_dir, **{**options, "max_steps": 3}), target=make_target(), dataset=dataset)
    assert [path.name for path in (run_dir / "checkpoints").iterdir()] == ["step-3"]
    with pytest.raises(ValueError, match="resume"):
        train(make_config(run_dir, **options), target=make_target(), dataset=dataset)
    resumed = train(make_config(run_dir, resume=True, **options), target=make_target(), dataset=dataset)

    assert resumed.state.step == 6 and resumed.state.epoch == reference.state.epoch
    for (name, expected), actual in zip(reference.drafter.named_parameters(), resumed.drafter.parameters()):
        assert torch.equal(expected, actual), name
    steps = {int(state["step"]) for state in resumed.optimizer.state_dict()["state"].values()}
    assert steps == {6}
    if options.get("next_token_input"):
        assert resumed.drafter.context_block.next_token_input.weight.abs().max() > 0  # it learns from zero
    assert [r["loss"] for r in read_metrics(run_dir) if "loss" in r] == \
        [r["loss"] for r in read_metrics(tmp_path / "reference") if "loss" in r]
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["step-3", "step-6"]


def test_sigterm_checkpoints_and_resume_continues(tmp_path):
    """A SIGTERM (a preempted job, `timeout`) ends training cleanly at an optimiser step with a checkpoint of that
    step and no export; `--resume` then carries on from it to the end."""
    make_target().float().save_pretrained(tmp_path / "target")
    repetitive_dataset(num_rows=10).save_to_disk(str(tmp_path / "data"))
    output_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "hf_specformer.training.train_drafter", "--target", str(tmp_path / "target"), "--data",
        str(tmp_path / "data"), "--output-dir", str(output_dir), "--per-device-batch-size", "2", "--draft-length", "2",
        "--eval-fraction", "0.2", "--save-every", "0", "--num-threads", "1", "--positions-per-sequence", "4",
    ]
    process = subprocess.Popen(command + ["--max-steps", "100000"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (output_dir / "metrics.jsonl").exists() or len(read_metrics(output_dir)) < 3:
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-4000:]
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-4000:]
    assert "continue with --resume" in stderr

    stopped_at = read_metrics(output_dir)[-1]["step"]
    assert [path.name for path in (output_dir / "checkpoints").iterdir()] == [f"step-{stopped_at}"]
    assert not (output_dir / "drafter").exists() and not (output_dir / "eval.json").exists()
    final_step = stopped_at + 2
    completed = subprocess.run(command + ["--max-steps", str(final_step), "--resume"], capture_output=True, text=True,
                               timeout=240)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert [record["step"] for record in read_metrics(output_dir) if "loss" in record] == \
        list(range(1, final_step + 1))
    assert json.loads((output_dir / "eval.json").read_text())["step"] == final_step
    assert (output_dir / "drafter" / "config.json").exists()


def test_accelerate_launch_two_processes(tmp_path):
    """`accelerate launch` with 2 CPU processes (DDP over gloo). In accelerate 1.15, `--cpu --num_processes 2`
    starts a single process (more only through mpirun), so the test asks for the multi-process launcher and keeps
    the processes on the CPU with ACCELERATE_USE_CPU."""
    target = make_target().float()
    target.save_pretrained(tmp_path / "target")
    repetitive_dataset(num_rows=10).save_to_disk(str(tmp_path / "data"))
    output_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
        "-m", "hf_specformer.training.train_drafter", "--target", str(tmp_path / "target"),
        "--data", str(tmp_path / "data"),
        "--output-dir", str(output_dir), "--max-steps", "2", "--per-device-batch-size", "2", "--draft-length", "2",
        "--eval-fraction", "0.2", "--save-every", "1", "--num-threads", "1", "--positions-per-sequence", "4",
    ]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert (output_dir / "drafter" / "config.json").exists()
    metrics = read_metrics(output_dir)
    assert [record["step"] for record in metrics if "loss" in record] == [1, 2]
    evaluation = json.loads((output_dir / "eval.json").read_text())
    assert evaluation["num_processes"] == 2 and evaluation["num_sequences"] == 2
    assert sorted(path.name for path in (output_dir / "checkpoints").iterdir()) == ["step-1", "step-2"]


# ----- evaluation ----------------------------------------------------------------------------------------------
def test_acceptance_steps_of_perfect_and_useless_drafts():
    tokens = torch.arange(100, 130)
    start = 4
    positions = torch.arange(start, len(tokens) - 2)
    perfect = torch.stack([tokens[(positions + 2 + j).clamp(max=len(tokens) - 1)] for j in range(4)], dim=1)
    for k in range(1, 5):
        steps = acceptance_steps(perfect, tokens, start, k)
        assert steps and all(step == k + 1 for step in steps)
    assert set(acceptance_steps(torch.zeros_like(perfect), tokens, start, 4)) == {1}
    half = perfect.clone()
    half[:, 2:] = 0  # the first two slots right, then wrong: each step accepts 2 drafts + the target's token
    assert set(acceptance_steps(half, tokens, start, 4)) == {3}


def test_tree_acceptance_steps_take_the_longest_matching_branch():
    tokens = torch.arange(100, 130)
    start = 4
    positions = torch.arange(start, len(tokens) - 2)
    perfect = torch.stack([tokens[(positions + 2 + j).clamp(max=len(tokens) - 1)] for j in range(3)], dim=1)
    ranked = torch.stack([torch.zeros_like(perfect), perfect], dim=2)  # [P, 3 slots, 2 ranks]: rank 1 is right
    ranked[:, 1:, 0] = perfect[:, 1:]  # ... and rank 0 too at slots 2 and 3
    assert set(tree_acceptance_steps(ranked, tokens, start, [(0, 0, 0)])) == {1}  # the argmax chain misses slot 1
    assert set(tree_acceptance_steps(ranked, tokens, start, [(0, 0, 0), (1, 0, 0)])) == {4}
    assert set(tree_acceptance_steps(ranked, tokens, start, [(0, 0, 0), (1,)])) == {2}  # a one-token branch
    assert set(tree_acceptance_steps(ranked, tokens, start, [(1, 1, 1), (1, 0)])) == {4}  # the longest branch wins
    assert tree_acceptance_steps(ranked[..., :1], tokens, start, [(0, 0, 0)]) == \
        acceptance_steps(ranked[..., 0], tokens, start, 3)


def test_best_of_lookup_steps_take_lookup_where_the_text_repeats():
    period = torch.arange(100, 110)
    tokens = torch.cat([period, period, period])  # [30]
    start, k = 4, 3
    useless = torch.zeros(len(tokens) - 2 - start, k, dtype=torch.long)
    assert set(acceptance_steps(useless, tokens, start, k)) == {1}
    # at t = 4..9 the committed prefix (up to x_{t+1}) holds no repeated bigram, so only the target's token counts;
    # from t = 10 on its last bigram occurred 10 tokens before, and lookup's drafts are the k tokens after it
    assert best_of_lookup_steps(useless, tokens, start, k, (2, 3, 4)) == [1] * 6 + [k + 1] * 4
    # 4-grams alone first repeat at t = 12 (x_10..x_13 = x_0..x_3)
    assert best_of_lookup_steps(useless, tokens, start, k, ngram_sizes=(4,)) == [1] * 8 + [k + 1] * 4
    positions = torch.arange(start, len(tokens) - 2)
    perfect = torch.stack([tokens[(positions + 2 + j).clamp(max=len(tokens) - 1)] for j in range(k)], dim=1)
    assert best_of_lookup_steps(perfect, tokens, start, k, (2, 3, 4)) == acceptance_steps(perfect, tokens, start, k)


def test_ranked_draft_tokens_start_with_the_argmax():
    target = make_target()
    drafter = make_drafter(target, draft_length=4).eval()
    ids = torch.tensor(random_dataset()[0]["input_ids"])
    argmax = draft_tokens(target, drafter, ids, 5, 3, chunk_size=8)
    ranked = draft_tokens(target, drafter, ids, 5, 3, chunk_size=8, ranks=2)
    assert ranked.shape == (*argmax.shape, 2) and argmax.shape == (len(ids) - 2 - 5, 3)
    assert torch.equal(ranked[..., 0], argmax) and (ranked[..., 0] != ranked[..., 1]).all()


def test_evaluate_kappa_bounds_and_random_data():
    target = make_target()
    drafter = make_drafter(target, draft_length=4).train()  # evaluated in eval mode, then given back in train mode
    random_rows = random_dataset()
    result = evaluate_kappa(target, drafter, random_rows, max_k=4)
    assert result["num_sequences"] == 6 and result["num_positions"] == 6 * (40 - 2 - 4)
    assert all(1.0 <= kappa <= k + 1 for k, kappa in enumerate(result["kappa"], start=1))
    assert all(kappa < 1.1 for kappa in result["kappa"])  # untrained drafter, random tokens: nothing accepted
    assert all(0.0 <= accuracy < 0.1 for accuracy in result["slot_accuracy"])
    assert drafter.training is True


def test_evaluate_kappa_on_replies_shorter_than_the_drafts():
    """Sequences with 2 slot-1 labels and max_k = 4: slot 2 has 1 label, slots 3 and 4 none (counted as 0, not read
    from the wrong end of the drafts)."""
    target = make_target()
    drafter = make_drafter(target, draft_length=4).eval()
    rows = random_dataset(num_rows=3, length=8)
    result = evaluate_kappa(target, drafter, rows, max_k=4)
    assert result["num_positions"] == 3 * 2
    hits = torch.zeros(2)
    for row in rows:
        tokens = torch.tensor(row["input_ids"])
        drafts = draft_tokens(target, drafter, tokens, 4, 4)
        hits += torch.stack([(drafts[:2, 0] == tokens[6:]).sum(), (drafts[:1, 1] == tokens[7:]).sum()])
    assert result["slot_accuracy"] == pytest.approx([hits[0].item() / 6, hits[1].item() / 3, 0.0, 0.0])


def test_confidence_bins_split_slot_one_accuracy_by_the_targets_probability():
    hits = torch.tensor([True, False, True, True, False, True])
    confidence = torch.tensor([0.1, 0.4, 0.6, 0.9, 0.97, 1.0])
    bins = confidence_bins(hits, confidence, edges=(0.5, 0.95))
    assert [(b["low"], b["high"]) for b in bins] == [(0.0, 0.5), (0.5, 0.95), (0.95, 1.0)]
    assert [b["share"] for b in bins] == [2 / 6, 2 / 6, 2 / 6]  # a probability of 1.0 falls in the last bin
    assert [b["accuracy"] for b in bins] == [0.5, 1.0, 0.5]
    empty = confidence_bins(hits, torch.full((6,), 0.2), edges=(0.5,))
    assert empty[0]["accuracy"] == 4 / 6 and empty[1]["share"] == 0.0 and empty[1]["accuracy"] is None


def test_label_probabilities_are_the_targets_own():
    target = make_target()
    ids = torch.tensor(random_dataset()[0]["input_ids"])
    output = target(ids[None], output_hidden_states=True)
    expected = output.logits[0].float().softmax(-1)[torch.arange(5, 15), ids[6:16]]
    torch.testing.assert_close(label_probabilities(target, output.hidden_states, ids, 4, 10), expected)


def test_evaluate_kappa_separates_vocabulary_and_confidence():
    """The bins' accuracies, weighted by their shares, give slot 1's accuracy; the coverage is the share of slot-1
    labels in the draft vocabulary, 1.0 without one."""
    target = make_target()
    drafter = make_drafter(target, draft_length=3).eval()
    rows = random_dataset()
    result = evaluate_kappa(target, drafter, rows, max_k=3)
    bins = result["slot1_by_target_confidence"]
    assert result["draft_vocab_coverage"] == 1.0 and 0.0 < result["mean_target_confidence"] < 1.0
    assert sum(b["share"] for b in bins) == pytest.approx(1.0)
    assert sum(b["share"] * b["accuracy"] for b in bins if b["share"]) == pytest.approx(result["slot_accuracy"][0])
    vocab = torch.arange(0, target.config.vocab_size, 2)
    drafter.set_draft_vocab(vocab)
    labels = torch.cat([torch.tensor(row["input_ids"][row["prompt_length"] + 1:]) for row in rows])
    covered = evaluate_kappa(target, drafter, rows, max_k=3)["draft_vocab_coverage"]
    assert covered == pytest.approx(torch.isin(labels, vocab).double().mean().item())
