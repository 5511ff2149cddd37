"""The configuration of drafter training (`DrafterTrainingConfig`), its options and their checks."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Literal


def option(default=MISSING, help: str = ""):
    """A field with its command-line `help` (no default: a required option)."""
    return field(default=default, metadata={"help": help})


@dataclass
class DrafterTrainingConfig:
    """Options of a drafter training run: one field per command-line option (`--field-name`), each with its `help`
    (`hf-specformer train --help`); docs/training.md explains the recipe."""

    data: str = option(help="Distill output folder or a `save_to_disk` dataset folder.")
    output_dir: str = option(help="Folder for checkpoints, metrics.jsonl, eval.json and drafter/.")
    target: str | None = option(None, "Target model: smollm2, a folder, a .gguf file (default: the one the data "
                                      "was distilled from).")
    draft_length: int = option(8, "l_d, the number of draft slots.")
    next_token_input: bool = option(False, "The drafter also reads the token after each position (not in the paper).")
    epochs: float = option(1.0, "Passes over the training split (unless max_steps).")
    max_steps: int | None = option(None, "Optimiser steps; overrides epochs.")
    per_device_batch_size: int = option(8, "Sequences per micro-batch and process.")
    gradient_accumulation_steps: int = option(1, "Micro-batches per optimiser step.")
    learning_rate: float = option(5e-4, "Peak learning rate.")
    min_learning_rate: float = option(1e-5, "Final learning rate of the cosine decay.")
    warmup_ratio: float = option(0.05, "Fraction of steps with linear warm-up.")
    weight_decay: float = option(0.0, "AdamW weight decay of weight matrices.")
    adam_eps: float = option(1e-8, "AdamW epsilon.")
    max_grad_norm: float = option(1.0, "Gradient clipping norm (0: no clipping).")
    max_length: int = option(768, "Cut sequences to this many tokens.")
    cut_loops: int = option(0, "Cut each training reply where it first repeats an N-token window (0: off).")
    positions_per_sequence: int = option(64, "Random reply positions per sequence for the slot stage (0: all).")
    ce_positions_per_sequence: int = option(0, "Of those, how many also get the cross-entropy (0: all of them).")
    feature_loss_weight: float = option(0.0, "Weight of the feature loss against the target's last hidden state "
                                             "(0: off).")
    soft_label_weight: float = option(0.0, "Weight of the forward KL from the target's next-token distribution "
                                           "(0: off).")
    cache_target_states: bool = option(False, "Keep each training sequence's target states in memory after its "
                                              "first pass.")
    draft_vocab_size: int = option(0, "Draft only the N most frequent reply tokens of the training data (0: all).")
    draft_vocab_loss: bool = option(False, "Score only the draft vocabulary in the losses (labels outside it skipped).")
    loss_slots: int = option(0, "Losses on the first N slots only (0: all l_d).")
    eval_fraction: float = option(0.05, "Share of sequences held out for evaluation.")
    eval_data: str | None = option(None, "Held-out data folder evaluated instead of a split of --data (needs "
                                        "--eval-fraction 0).")
    eval_every: int = option(500, "Evaluate every N optimiser steps (0: at the end).")
    save_every: int = option(500, "Checkpoint every N optimiser steps (0: never).")
    mixed_precision: Literal["no", "bf16"] = option("no", "Autocast precision.")
    target_dtype: Literal["float32", "bfloat16", "float16"] = option("float32", "dtype of the frozen target (the "
                                                                     "device is accelerate's).")
    save_dtype: Literal["float32", "bfloat16", "float16"] = option("bfloat16", "Dtype of the exported drafter.")
    seed: int = option(0, "Random seed.")
    num_threads: int = option(0, "Torch CPU threads per process (0: default).")
    resume: bool = option(False, "Resume from the latest checkpoint in output_dir.")
    init_from: str | None = option(None, "Start from this drafter folder's weights instead of a fresh init.")
    intermediate_size: int = option(0, "A fresh drafter's slot SwiGLU width (0: the target's MLP width).")
    new_parameter_learning_rate_scale: float = option(1.0, "With init_from: learning-rate multiple of the "
                                                           "parameters it lacks.")
    lora: bool = option(False, "Adapt the init_from drafter with a LoRA adapter (PEFT).")
    lora_rank: int = option(16, "LoRA rank r.")
    lora_alpha: float = option(32.0, "LoRA alpha (updates scaled by alpha / r).")
    lora_dropout: float = option(0.0, "LoRA dropout.")

    def __post_init__(self):
        positive = ("draft_length", "per_device_batch_size", "gradient_accumulation_steps", "learning_rate", "adam_eps",
                    "new_parameter_learning_rate_scale", "lora_rank", "lora_alpha")
        non_negative = ("weight_decay", "max_grad_norm", "positions_per_sequence", "ce_positions_per_sequence",
                        "feature_loss_weight", "soft_label_weight", "draft_vocab_size", "loss_slots", "eval_every",
                        "save_every", "num_threads", "min_learning_rate", "intermediate_size", "cut_loops")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"`{name}` must be positive, got {getattr(self, name)}.")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}.")
        if self.max_steps is None and self.epochs <= 0:
            raise ValueError(f"Set `epochs` > 0 or `max_steps`; got epochs={self.epochs} and no max_steps.")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"`max_steps` must be >= 1 when set, got {self.max_steps}.")
        if self.min_learning_rate > self.learning_rate:
            raise ValueError(
                f"`min_learning_rate` ({self.min_learning_rate}) must not exceed "
                f"`learning_rate` ({self.learning_rate})."
            )
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"`warmup_ratio` must be in [0, 1), got {self.warmup_ratio}.")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"`eval_fraction` must be in [0, 1), got {self.eval_fraction}.")
        if self.eval_data and self.eval_fraction > 0:
            raise ValueError(f"`eval_data` replaces the held-out split of `data`: set `eval_fraction` to 0, got "
                             f"{self.eval_fraction}.")
        if self.lora and not self.init_from:
            raise ValueError("`lora` adapts a trained drafter: set `init_from` to its folder.")
        if self.lora and self.next_token_input:
            raise ValueError("`lora` trains adapters of the drafter's existing layers only; add the next-token input "
                             "with full training (`init_from` without `lora`).")
        if self.init_from and self.intermediate_size:
            raise ValueError("`intermediate_size` sets a fresh drafter's width; an `init_from` drafter keeps its own.")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"`lora_dropout` must be in [0, 1), got {self.lora_dropout}.")
        if self.loss_slots > self.draft_length:
            raise ValueError(f"`loss_slots` ({self.loss_slots}) must not exceed `draft_length` ({self.draft_length}).")
        if self.draft_vocab_loss and not (self.init_from or self.draft_vocab_size):
            raise ValueError("`draft_vocab_loss` needs a draft vocabulary: set `draft_vocab_size`, or `init_from` a "
                             "drafter that has one.")
        if self.cut_loops == 1:
            raise ValueError("`cut_loops` must be 0 (off) or >= 2: a 1-token window repeats in nearly every reply.")
        if self.max_length < 3:
            raise ValueError(f"`max_length` must be >= 3 (a position and the token two ahead), got {self.max_length}.")
