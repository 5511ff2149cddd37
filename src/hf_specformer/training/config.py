"""The configuration of drafter training (`DrafterTrainingConfig`), its options and their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hf_specformer.targets import DEFAULT_TARGET


@dataclass
class DrafterTrainingConfig:
    """Options of a drafter training run (one field per command-line option, `--field-name`).

    Args:
        data: self-distilled data: a distill output folder (its `dataset/`, else the records of a run in
            progress) or a folder written by `Dataset.save_to_disk`, with `input_ids` and `prompt_length`.
        output_dir: where checkpoints, `metrics.jsonl`, `eval.json` and the exported `drafter/` go.
        target: the frozen target (`smollm2`, a local folder, a `.gguf` file or a Hub name), loaded in float32.
        draft_length: l_d, the number of draft slots (all trained with equal weights, unless `loss_slots`).
        next_token_input: build the drafter with `SpecFormerConfig.next_token_input` (position t also reads x_{t+1};
            an extension, not in the paper). With `init_from` a drafter without it gains it, starting at zero.
        epochs: passes over the training split; ignored when `max_steps` is set.
        max_steps: optimiser steps to run; overrides `epochs` (the data is cycled as needed).
        per_device_batch_size: sequences per micro-batch and process.
        gradient_accumulation_steps: micro-batches per optimiser step.
        learning_rate: peak AdamW learning rate.
        min_learning_rate: learning rate at the end of the cosine decay.
        warmup_ratio: fraction of the optimiser steps with a linear warm-up.
        weight_decay: AdamW weight decay of the matrices (norm scales and biases have none).
        adam_eps: AdamW epsilon.
        max_grad_norm: gradient clipping norm; 0 disables clipping.
        max_length: sequences are cut to this many tokens (prompt included).
        cut_loops: cut each training reply after the first token that repeats a window of this many tokens seen
            earlier in the reply (`data.cut_loops`; the held-out replies stay whole). SmolLM2's greedy answers to
            synthesized prompts loop verbatim: with 16, 53% of the answers are cut and 37% of their reply tokens go,
            which prompt lookup drafts at run time anyway. 0 keeps every reply whole.
        positions_per_sequence: the slot stage runs only at this many random reply positions per sequence, while
            the cheap context stage covers every position. 0 uses every valid position.
        ce_positions_per_sequence: the l_d lm_head calls of the cross-entropy, which dominate a CPU step (V = 49152
            columns against d = 576), run only at this many of the slot-stage positions (a random subset); 0 uses
            all of them.
        feature_loss_weight: weight w of an auxiliary loss (not in the paper's final recipe; its code keeps an
            unused MSE-to-last-hidden-state option): smooth-L1 between the target's final norm of slot j's state at
            position t and the target's own last hidden state at t + 1 + j, which its lm_head turns into the
            distribution of x_{t+2+j}. It carries the target's whole next-token distribution rather than one
            label (as EAGLE's feature loss does) and costs d instead of V per slot, so it runs at every slot-stage
            position. The loss is `mean_j (CE_j + w * feature_j + w_s * soft_j)`; 0 disables it.
        soft_label_weight: weight w_s of soft-label distillation (DistillSpec, arXiv 2310.08461): the forward KL
            from the target's own next-token distribution at t + 1 + j (its lm_head on its last hidden state there)
            to slot j's, beside the hard label, at the cross-entropy's positions. It teaches a slot the tokens the
            target would also rank high, where the hard label keeps only its argmax. Costs one more lm_head per slot
            and position. 0 disables it.
        cache_target_states: keep each training sequence's target states (4 hooked + the last hidden state) in
            memory after its first forward, so later epochs skip the target. Costs about T * 5 * d * 4 bytes of RAM
            per sequence (1.5 GB for 1000 sequences of 170 tokens with d = 576).
        draft_vocab_size: restrict drafting to the N most frequent reply tokens of the training split
            (`SpecFormerForDrafting.set_draft_vocab`): the draft head then reads N rows of the lm_head instead of V.
            Set before the final evaluation and export, or before training with `draft_vocab_loss`. 0: no
            restriction (a drafter from `init_from` keeps its own).
        draft_vocab_loss: the cross-entropy and the soft labels score only the draft vocabulary's V_d columns (as
            EAGLE-3 and FR-Spec train), labels outside it skipped: those are the only tokens the drafter can draft,
            and the head, which dominates a CPU step, costs V_d / V as much (1/6 with 8,192 of SmolLM2's 49,152), so
            every position can get the cross-entropy. Needs a draft vocabulary: `init_from`'s, or
            `draft_vocab_size`'s, counted before training. Off: the whole vocabulary is scored.
        loss_slots: train only the first N of the l_d slots (0: all of them, equal weights, the paper's recipe).
            All l_d slots still enter the slots' attention, so the others serve as context; only the first N go on
            to the SwiGLU and the losses (a CPU step's head and slot MLP cost N / l_d as much). Drafting k <= N
            tokens loses nothing; drafts past slot N come from slots this run did not train.
        eval_fraction: share of the sequences held out (seeded shuffle) to measure the accepted length kappa.
        eval_data: a held-out data folder (as `data`) measured instead of a split of `data`, which is then trained
            on whole (needs `eval_fraction` 0): runs on different training sets compare on the same texts.
        eval_every: evaluate every this many optimiser steps (0: only at the end).
        save_every: checkpoint every this many optimiser steps (0: never).
        mixed_precision: `no` or `bf16` (autocast of the target, the drafter and the head; float32 weights).
        target_dtype: dtype the frozen target is loaded in (its hidden states are what the drafter learns from). The
            device is accelerate's (a GPU when there is one; `accelerate launch --cpu` for the CPU).
        save_dtype: dtype of the exported drafter weights.
        seed: seed of initialisation, data order, held-out split and position sampling.
        num_threads: torch CPU threads per process (0: torch's default).
        resume: continue from the latest checkpoint in `output_dir/checkpoints` (from scratch if there is none).
        init_from: a drafter folder whose weights start the run (e.g. continued training on more data).
        intermediate_size: width of the drafter's slot SwiGLU (0: the target's MLP width for a fresh drafter,
            `init_from`'s own otherwise). With `init_from`, a larger width widens the loaded drafter's SwiGLU by
            splitting its units (Net2Net, Chen et al. 2016): the drafter drafts nearly the same at step 0 and
            trains with more capacity (see `train_drafter.widen_swiglu`).
        new_parameter_learning_rate_scale: with `init_from`, the parameters that folder lacks (e.g. a next-token
            input added to a drafter trained without it) train at this multiple of the learning rate: a new matrix
            that starts at zero would otherwise grow only at the fine-tuning pace of the trained ones.
        lora: adapt the `init_from` drafter to new data (a user's domain) with a LoRA adapter (PEFT) on every linear
            layer of the drafter, its weights frozen: the run saves the adapter (`adapter/`, loadable with
            `PeftModel.from_pretrained(drafter, adapter_dir)`) and exports the merged drafter (`drafter/`). The
            drafter's acceptance table, if any, was calibrated before adaptation: rerun `hf-specformer calibrate`.
        lora_rank, lora_alpha, lora_dropout: the adapter's rank r, scale alpha (updates are scaled by alpha / r) and
            dropout.
    """

    data: str = field(metadata={"help": "Distill output folder or a `save_to_disk` dataset folder."})
    output_dir: str = field(metadata={"help": "Folder for checkpoints, metrics.jsonl, eval.json and drafter/."})
    target: str = field(default=DEFAULT_TARGET, metadata={"help": "Target model: smollm2, a folder, a .gguf file."})
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
    save_dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="bfloat16", metadata={"help": "Dtype of the exported drafter."}
    )
    seed: int = field(default=0, metadata={"help": "Random seed."})
    num_threads: int = field(default=0, metadata={"help": "Torch CPU threads per process (0: default)."})
    resume: bool = field(default=False, metadata={"help": "Resume from the latest checkpoint in output_dir."})
    init_from: str | None = field(
        default=None, metadata={"help": "Start from this drafter folder's weights instead of a fresh init."}
    )
    intermediate_size: int = field(
        default=0, metadata={"help": "Slot SwiGLU width (0: the target's, or init_from's); with init_from, widens it."}
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
        if self.lora and self.intermediate_size:
            raise ValueError("`lora` trains adapters of the drafter's existing layers only; widen its SwiGLU "
                             "(`intermediate_size`) with full training.")
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
