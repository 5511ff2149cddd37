"""Training a SpecFormer drafter on self-distilled data with `accelerate` (paper: Shi et al., AAAI-26, sec. 3).

    python -m hf_specformer.training.train_drafter --data DISTILLED --output-dir runs/smollm2
    accelerate launch -m hf_specformer.training.train_drafter --data ... --output-dir ...      # several processes (DDP)

The target stays frozen; the drafter's context stage runs over every position, its slot stage at sampled positions,
slot j learning x_{t+2+j} (`losses.py`). Runs resume exactly; SIGTERM or Ctrl-C checkpoints and stops.
"""

from __future__ import annotations


import json
import logging
import math
import random
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from tqdm.auto import tqdm
from transformers import HfArgumentParser, PreTrainedModel

from hf_specformer.hub.export import export_drafter
from hf_specformer.models.specformer import SpecFormerConfig, SpecFormerForDrafting
from hf_specformer.targets import DTYPES, load_data_target
from hf_specformer.training.checkpointing import (StopOnSignal, TrainerState, append_metrics, end_process_group,
                                                  list_checkpoints, read_metrics, restore_checkpoint, save_checkpoint,
                                                  trim_metrics, write_atomically)
from hf_specformer.training.config import DrafterTrainingConfig
from hf_specformer.training.data import (Batch, collate, cut_loops, epoch_batches, load_distilled, reply_vocabulary,
                                         split_train_eval, usable_rows)
from hf_specformer.training.evaluation import evaluate_kappa
from hf_specformer.training.optimization import build_optimizer, warmup_cosine
from hf_specformer.training.losses import SlotLosses, intra_batch_backward, sample_positions, slot_labels
from hf_specformer.training.target_states import TargetStateCache, future_states, next_token_ids

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.json"
DRAFTER_DIR = "drafter"
ADAPTER_DIR = "adapter"


# ----- training ------------------------------------------------------------------------------------------------
@dataclass
class TrainingResult:
    """What `train` returns: the trained (unwrapped, bound) drafter, the optimizer, the final state and evaluation.
    `completed` is False when a signal stopped the run early (then it was checkpointed, not evaluated or exported)."""

    drafter: SpecFormerForDrafting
    optimizer: torch.optim.Optimizer
    state: TrainerState
    evaluation: dict
    completed: bool = True


def build_drafter(target: PreTrainedModel,
                  config: DrafterTrainingConfig) -> tuple[SpecFormerForDrafting | PeftModel, frozenset[str]]:
    """The drafter to train (fresh, or `init_from`'s weights, as a `PeftModel` with `lora`), bound to the target,
    and the names of its parameters that `init_from` did not hold."""
    if not config.init_from:
        drafter_config = SpecFormerConfig.from_target_config(target.config, draft_length=config.draft_length,
                                                             next_token_input=config.next_token_input)
        drafter_config.intermediate_size = config.intermediate_size or drafter_config.intermediate_size
        drafter = SpecFormerForDrafting(drafter_config).to(target.dtype)
        return drafter.bind_target(target).train(), frozenset()
    extra = {"next_token_input": True} if config.next_token_input else {}
    drafter, loading = SpecFormerForDrafting.from_pretrained(config.init_from, dtype=target.dtype,
                                                             output_loading_info=True, **extra)
    if drafter.config.draft_length != config.draft_length:
        raise ValueError(
            f"`init_from` has draft_length {drafter.config.draft_length}, the run asks for {config.draft_length}."
        )
    drafter.bind_target(target)
    if config.lora:
        lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                          target_modules="all-linear")
        with warnings.catch_warnings():  # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            return get_peft_model(drafter, lora).train(), frozenset()
    return drafter.train(), frozenset(loading["missing_keys"])


def scored_vocabulary(drafter: SpecFormerForDrafting | PeftModel, train_set: Dataset,
                      config: DrafterTrainingConfig) -> None:
    """With `draft_vocab_loss`: the draft vocabulary the losses score, set before training: `draft_vocab_size`
    tokens counted on the training split, else the `init_from` drafter's own (a `ValueError` if it has none)."""
    if config.draft_vocab_size:
        drafter.set_draft_vocab(reply_vocabulary(train_set, config.draft_vocab_size))
    elif drafter.draft_vocab_ids is None:
        raise ValueError(f"`draft_vocab_loss`: the drafter in {config.init_from} has no draft vocabulary; set "
                         "`draft_vocab_size`.")


def total_optimizer_steps(config: DrafterTrainingConfig, batches_per_epoch: int) -> int:
    """`max_steps`, else the optimiser steps of `epochs` passes (at least 1)."""
    if config.max_steps is not None:
        return config.max_steps
    return max(1, int(config.epochs * batches_per_epoch) // config.gradient_accumulation_steps)


def micro_batches(dataset: Dataset, config: DrafterTrainingConfig, accelerator: Accelerator,
                  state: TrainerState) -> Iterator[tuple[int, int, list[int], Batch, random.Random]]:
    """Endless `(epoch, batch index, row ids, batch, position rng)` from `state.epoch` / `state.batch_index` on."""
    epoch, first = state.epoch, state.batch_index
    while True:
        batches = epoch_batches(len(dataset), config.per_device_batch_size, accelerator.num_processes,
                                accelerator.process_index, epoch, config.seed)
        for index in range(first, len(batches)):
            rng = random.Random(f"positions-{config.seed}-{epoch}-{index}-{accelerator.process_index}")
            rows = batches[index]
            yield epoch, index, rows, collate(dataset[rows], config.max_length).to(accelerator.device), rng
        epoch, first = epoch + 1, 0


def train_micro_batch(accelerator: Accelerator, target_states: TargetStateCache, drafter: torch.nn.Module,
                      row_ids: list[int], batch: Batch, rng: random.Random,
                      config: DrafterTrainingConfig) -> SlotLosses:
    """Forward and backward of one micro-batch; `drafter` is the prepared (possibly DDP-wrapped) module."""
    unwrapped = accelerator.unwrap_model(drafter)
    with accelerator.autocast():
        hooked, last = target_states.batch(row_ids, batch)
        positions, mask = sample_positions(batch.lengths.tolist(), batch.prompt_lengths.tolist(),
                                           config.positions_per_sequence, rng)
        positions, mask = positions.to(accelerator.device), mask.to(accelerator.device)
        num_slots = config.loss_slots or config.draft_length  # all l_d slots attend; these continue to the losses
        output = drafter(hooked, attention_mask=batch.attention_mask, use_cache=False, draft_positions=positions,
                         num_draft_tokens=num_slots, return_logits=False,
                         next_token_ids=next_token_ids(batch.input_ids))
        labels = slot_labels(batch, positions, mask, num_slots)
        needs_states = config.feature_loss_weight > 0 or config.soft_label_weight > 0
        features = future_states(last, positions, num_slots) if needs_states else None
        return intra_batch_backward(unwrapped, output.slot_hidden_states, labels, backward=lambda tensor,
                                    gradient: accelerator.backward(tensor, gradient=gradient), feature_targets=features,
                                    feature_weight=config.feature_loss_weight,
                                    num_ce_positions=config.ce_positions_per_sequence,
                                    soft_label_weight=config.soft_label_weight,
                                    draft_vocab_loss=config.draft_vocab_loss)


class WindowStats:
    """Losses, tokens and time of the micro-batches of one optimiser step."""

    def __init__(self):
        self.losses: list[SlotLosses] = []
        self.tokens = 0
        self.sequences = 0
        self.start = time.perf_counter()

    def add(self, losses: SlotLosses, batch: Batch) -> None:
        self.losses.append(losses)
        self.tokens += int(batch.lengths.sum())
        self.sequences += batch.lengths.shape[0]

    def summary(self, accelerator: Accelerator) -> dict:
        """Losses averaged over micro-batches and processes, and token and sequence rates over all processes."""
        device = accelerator.device
        rows = [[losses.total, *losses.cross_entropy, *losses.feature, *losses.soft] for losses in self.losses]
        means = accelerator.reduce(torch.tensor(rows, device=device).mean(0), reduction="mean").tolist()
        counts = accelerator.reduce(torch.tensor([self.tokens, self.sequences], device=device), reduction="sum")
        seconds = time.perf_counter() - self.start
        num_slots = len(self.losses[0].cross_entropy)
        return {
            "loss": means[0],
            "slot_losses": [round(value, 5) for value in means[1 : 1 + num_slots]],
            "feature_losses": [round(value, 5) for value in means[1 + num_slots : 1 + 2 * num_slots]],
            "soft_label_losses": [round(value, 5) for value in means[1 + 2 * num_slots :]],
            "seconds": round(seconds, 3),
            "tokens_per_second": round(counts[0].item() / seconds, 1),
            "sequences_per_second": round(counts[1].item() / seconds, 3),
        }


def evaluate_heldout(target: PreTrainedModel, drafter: SpecFormerForDrafting, eval_set: Dataset,
                     config: DrafterTrainingConfig) -> dict:
    """`evaluate_kappa` of `drafter` on `eval_set`'s sequences cut to `config.max_length`, k up to l_d."""
    rows = ({"input_ids": ids[: config.max_length], "prompt_length": pl}
            for ids, pl in zip(eval_set["input_ids"], eval_set["prompt_length"]))
    return evaluate_kappa(target, drafter, rows, config.draft_length)


def run_evaluation(accelerator: Accelerator, target: PreTrainedModel, drafter: torch.nn.Module, eval_set: Dataset,
                   config: DrafterTrainingConfig, state: TrainerState, path: Path) -> dict:
    """kappa on the held-out split, on the main process only (the others wait); logged to the metrics file."""
    evaluation = {}
    if accelerator.is_main_process and len(eval_set) > 0:
        evaluation = evaluate_heldout(target, accelerator.unwrap_model(drafter), eval_set, config)
        append_metrics(path, {"step": state.step, "eval": evaluation})
        logger.info("step %d: kappa %s", state.step, [value and round(value, 3) for value in evaluation["kappa"]])
    accelerator.wait_for_everyone()
    return evaluation


def train(config: DrafterTrainingConfig, target: PreTrainedModel | None = None,
          dataset: Dataset | None = None) -> TrainingResult:
    """Trains a drafter for `config.target` (or the given `target` model) on `config.data` (or `dataset`)."""
    accelerator = Accelerator(
        mixed_precision=config.mixed_precision,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        step_scheduler_with_optimizer=False,  # stepped by hand once per optimiser step, whatever the process count
    )
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    output_dir = Path(config.output_dir)
    metrics_path = output_dir / METRICS_FILE
    checkpoints = list_checkpoints(output_dir)
    if checkpoints and not config.resume:
        raise ValueError(f"{output_dir} already holds checkpoints; pass `resume` or use another output folder.")
    output_dir.mkdir(parents=True, exist_ok=True)
    set_seed(config.seed)

    if target is None:
        target = load_data_target(config.data, config.target, dtype=DTYPES[config.target_dtype])
    target = target.requires_grad_(False).eval().to(accelerator.device)
    dataset = load_distilled(config.data) if dataset is None else dataset
    train_set, eval_set = split_train_eval(dataset, config.max_length, config.eval_fraction, config.seed)
    if config.eval_data:
        eval_set = usable_rows(load_distilled(config.eval_data), config.max_length)
    if config.cut_loops:
        whole = sum(map(len, train_set["input_ids"]))
        train_set = cut_loops(train_set, config.cut_loops)
        logger.info("cut_loops=%d keeps %d of %d training tokens", config.cut_loops,
                    sum(map(len, train_set["input_ids"])), whole)
    batches_per_epoch = math.ceil(len(train_set) / (config.per_device_batch_size * accelerator.num_processes))
    total_steps = total_optimizer_steps(config, batches_per_epoch)

    drafter, new_parameters = build_drafter(target, config)
    if config.draft_vocab_loss:
        scored_vocabulary(drafter, train_set, config)
    optimizer = build_optimizer(drafter, config, new_parameters)
    schedule = warmup_cosine(total_steps, config.warmup_ratio, config.min_learning_rate / config.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    drafter, optimizer, scheduler = accelerator.prepare(drafter, optimizer, scheduler)

    state = TrainerState()
    if checkpoints:
        state = restore_checkpoint(accelerator, checkpoints[-1])
        logger.info("resumed from %s (step %d)", checkpoints[-1], state.step)
    if accelerator.is_main_process:
        trim_metrics(metrics_path, state.step)
    logger.info("%d train / %d held-out sequences, %d optimiser steps", len(train_set), len(eval_set), total_steps)
    initial = initial_evaluation(accelerator, target, drafter, eval_set, config, metrics_path)

    bar = tqdm(total=total_steps, initial=state.step, desc="train", disable=not accelerator.is_local_main_process)
    window = WindowStats()
    target_states = TargetStateCache(target, accelerator.unwrap_model(drafter), keep=config.cache_target_states)
    batches = micro_batches(train_set, config, accelerator, state)
    stopped = False
    with StopOnSignal() as stop:
        while state.step < total_steps and not stopped:
            epoch, index, row_ids, batch, rng = next(batches)
            with accelerator.accumulate(drafter):
                losses = train_micro_batch(accelerator, target_states, drafter, row_ids, batch, rng, config)
            window.add(losses, batch)
            state.epoch, state.batch_index = epoch, index + 1
            if not accelerator.sync_gradients:
                continue
            grad_norm = accelerator.clip_grad_norm_(drafter.parameters(), config.max_grad_norm) \
                if config.max_grad_norm > 0 else None
            learning_rate = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            state.step += 1
            state.metrics = {"step": state.step, "epoch": epoch, **window.summary(accelerator), "lr": learning_rate}
            if grad_norm is not None:
                state.metrics["grad_norm"] = round(float(grad_norm), 5)
            if accelerator.is_main_process:
                append_metrics(metrics_path, state.metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{state.metrics['loss']:.4f}", lr=f"{learning_rate:.2e}")
            stopped = stop.agreed(accelerator) and state.step < total_steps
            if config.eval_every and state.step % config.eval_every == 0 and state.step < total_steps and not stopped:
                run_evaluation(accelerator, target, drafter, eval_set, config, state, metrics_path)
            if stopped or (config.save_every and state.step % config.save_every == 0):
                save_checkpoint(accelerator, output_dir, state)
            window = WindowStats()
    bar.close()
    if stopped:
        logger.warning("stopped at step %d of %d; continue with --resume", state.step, total_steps)
        return TrainingResult(accelerator.unwrap_model(drafter), optimizer, state, evaluation={}, completed=False)

    if config.draft_vocab_size and not config.draft_vocab_loss:
        accelerator.unwrap_model(drafter).set_draft_vocab(reply_vocabulary(train_set, config.draft_vocab_size))
    evaluation = run_evaluation(accelerator, target, drafter, eval_set, config, state, metrics_path)
    unwrapped = export_trained(accelerator, accelerator.unwrap_model(drafter), output_dir, config)
    if accelerator.is_main_process:
        summary = {"step": state.step, "num_processes": accelerator.num_processes, **evaluation}
        if initial:
            summary["initial"] = initial
        write_atomically(output_dir / EVAL_FILE, json.dumps(summary, indent=2, allow_nan=False))
    accelerator.wait_for_everyone()
    return TrainingResult(drafter=unwrapped, optimizer=optimizer, state=state, evaluation=evaluation)


def initial_evaluation(accelerator: Accelerator, target: PreTrainedModel, drafter: torch.nn.Module, eval_set: Dataset,
                       config: DrafterTrainingConfig, path: Path) -> dict:
    """With `init_from`, kappa of the starting drafter on the held-out split (what the run improves on), logged as
    step 0; read back from the log when the run resumes. Empty for a drafter trained from scratch."""
    if not config.init_from:
        return {}
    logged = [record["eval"] for record in read_metrics(path) if record.get("step") == 0 and "eval" in record] \
        if path.exists() else []
    if logged:
        return logged[-1]
    return run_evaluation(accelerator, target, drafter, eval_set, config, TrainerState(), path)


def export_trained(accelerator: Accelerator, drafter: SpecFormerForDrafting | PeftModel, output_dir: Path,
                   config: DrafterTrainingConfig) -> SpecFormerForDrafting:
    """Writes the trained drafter's Hub folder (`drafter/`) on the main process and returns the drafter. A LoRA
    run first saves its adapter (`adapter/`) and then merges it into the drafter's weights."""
    if isinstance(drafter, PeftModel):
        if accelerator.is_main_process:
            drafter.save_pretrained(output_dir / ADAPTER_DIR)
        drafter = drafter.merge_and_unload()
    if accelerator.is_main_process:
        export_drafter(drafter, output_dir / DRAFTER_DIR, dtype=DTYPES[config.save_dtype])
    return drafter


def parse_config(argv: list[str] | None = None) -> DrafterTrainingConfig:
    """`DrafterTrainingConfig` from command-line options (`--output-dir` or `--output_dir`, `--resume`, ...)."""
    parser = HfArgumentParser(DrafterTrainingConfig, prog="hf-specformer train", description=__doc__.split("\n\n")[0])
    for action in parser._actions:  # dashes in help and usage, as every other command; underscores still parse
        dashed = [option.replace("_", "-") for option in action.option_strings]
        for option in dashed:
            parser._option_string_actions.setdefault(option, action)
        action.option_strings = list(dict.fromkeys(dashed))
        if action.default is None and action.help:  # no "(default: None)" (`%(default).0s` prints nothing)
            action.help += (" (required)" if action.required else "") + "%(default).0s"
    (config,) = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    return config


def main(argv: list[str] | None = None) -> TrainingResult:
    """Entry point of `hf-specformer train` and `accelerate launch -m hf_specformer.training.train_drafter`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = parse_config(argv)
    result = train(config)
    end_process_group()
    if result.evaluation:  # the main process of a completed run
        kappas = result.evaluation["kappa"]
        kappa = ", ".join("-" if value is None else f"{value:.2f}" for value in kappas)
        print(f"wrote {Path(config.output_dir) / DRAFTER_DIR}: {result.state.step} steps, final loss "
              f"{result.state.metrics['loss']:.3f}, held-out kappa at k = 1..{len(kappas)}: {kappa}")
    return result


if __name__ == "__main__":
    main()
