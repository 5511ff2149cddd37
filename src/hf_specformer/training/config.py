"""The configuration of drafter training (`DrafterTrainingConfig`), its options and their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal



@dataclass
class DrafterTrainingConfig:
    """Options of a drafter training run: one field per command-line option (`--field-name`), each with its `help`
    (`hf-specformer train --help`); docs/training.md explains the recipe."""

    data: str = field(metadata={"help": "Distill output folder or a `save_to_disk` dataset folder."})
    output_dir: str = field(metadata={"help": "Folder for checkpoints, metrics.jsonl, eval.json and drafter/."})
    target: str | None = field(default=None, metadata={"help": "Target model: smollm2, a folder, a .gguf file "
                                                               "(default: the one the data was distilled from)."})
    draft_length: int = field(default=8, metadata={"help": "l_d, the number of draft slots."})
    next_token_input: bool = field(
        default=False, metadata={"help": "The drafter also reads the token after each position (not in the paper)."}
    )
    epochs: float = field(default=1.0, metadata={"help": "Passes over the training split (unless max_steps)."})
    max_steps: int | None = field(default=None, metadata={"help": "Optimiser steps; overrides epochs."})
    per_device_batch_size: int = field(default=8, metadata={"help": "Sequences per micro-batch and process."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimiser step."})
    learning_rate: float = field(default=5e-4, metadata={"help": "Peak learning rate."})
    min_learning_rate: float = field(default=1e-5, metadata={"help": "Final learning rate of the cosine decay."})
    warmup_ratio: float = field(default=0.05, metadata={"help": "Fraction of steps with linear warm-up."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay of weight matrices."})
    adam_eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0: no clipping)."})
    max_length: int = field(default=768, metadata={"help": "Cut sequences to this many tokens."})
    cut_loops: int = field(
        default=0, metadata={"help": "Cut each training reply where it first repeats an N-token window (0: off)."}
    )
    positions_per_sequence: int = field(
        default=64, metadata={"help": "Random reply positions per sequence for the slot stage (0: all)."}
    )
    ce_positions_per_sequence: int = field(
        default=0, metadata={"help": "Of those, how many also get the cross-entropy (0: all of them)."}
    )
    feature_loss_weight: float = field(
        default=0.0, metadata={"help": "Weight of the feature loss against the target's last hidden state (0: off)."}
    )
    soft_label_weight: float = field(
        default=0.0, metadata={"help": "Weight of the forward KL from the target's next-token distribution (0: off)."}
    )
    cache_target_states: bool = field(
        default=False, metadata={"help": "Keep each training sequence's target states in memory after its first pass."}
    )
    draft_vocab_size: int = field(
        default=0, metadata={"help": "Draft only the N most frequent reply tokens of the training data (0: all)."}
    )
    draft_vocab_loss: bool = field(
        default=False, metadata={"help": "Score only the draft vocabulary in the losses (labels outside it skipped)."}
    )
    loss_slots: int = field(default=0, metadata={"help": "Losses on the first N slots only (0: all l_d)."})
    eval_fraction: float = field(default=0.05, metadata={"help": "Share of sequences held out for evaluation."})
    eval_data: str | None = field(
        default=None, metadata={"help": "Held-out data folder evaluated instead of a split of --data (needs "
                                        "--eval-fraction 0)."}
    )
    eval_every: int = field(default=500, metadata={"help": "Evaluate every N optimiser steps (0: at the end)."})
    save_every: int = field(default=500, metadata={"help": "Checkpoint every N optimiser steps (0: never)."})
    mixed_precision: Literal["no", "bf16"] = field(default="no", metadata={"help": "Autocast precision."})
    target_dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", metadata={"help": "dtype of the frozen target (the device is accelerate's)."}
    )
    save_dtype: Literal["float32", "bfloat16", "float16"] = field(default="bfloat16",
                                                                  metadata={"help": "Dtype of the exported drafter."})
    seed: int = field(default=0, metadata={"help": "Random seed."})
    num_threads: int = field(default=0, metadata={"help": "Torch CPU threads per process (0: default)."})
    resume: bool = field(default=False, metadata={"help": "Resume from the latest checkpoint in output_dir."})
    init_from: str | None = field(
        default=None, metadata={"help": "Start from this drafter folder's weights instead of a fresh init."}
    )
    intermediate_size: int = field(
        default=0, metadata={"help": "A fresh drafter's slot SwiGLU width (0: the target's MLP width)."}
    )
    new_parameter_learning_rate_scale: float = field(
        default=1.0, metadata={"help": "With init_from: learning-rate multiple of the parameters it lacks."}
    )
    lora: bool = field(default=False, metadata={"help": "Adapt the init_from drafter with a LoRA adapter (PEFT)."})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank r."})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (updates scaled by alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})

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
