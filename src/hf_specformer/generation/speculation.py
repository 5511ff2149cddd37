"""`SpeculationConfig`: how one call speculates, validated once and completed from transformers' names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transformers import GenerationConfig

from .scheduler import StepCosts
from .suffix import SuffixIndex
from .verification import KERNEL_BACKENDS

SCHEDULES = ("goodput", "fixed")

TRANSFORMERS_NAMES = {"num_assistant_tokens": "num_draft_tokens",
                      "assistant_confidence_threshold": "confidence_threshold",
                      "max_matching_ngram_size": "lookup_ngram_size",
                      "prompt_lookup_num_tokens": "lookup_ngram_size",
                      "num_assistant_tokens_schedule": "schedule"}
"""transformers' assisted-generation arguments -> the field each sets."""

TRANSFORMERS_SCHEDULES = {"constant": "fixed", "heuristic": "goodput", "heuristic_transient": "goodput"}


@dataclass(frozen=True)
class SpeculationConfig:
    """How a call speculates (transformers' equivalent names in brackets).

    Args:
        num_draft_tokens: k drafts per row and step (None: the drafter's `num_speculative_tokens`; 0: plain
            decoding) [`num_assistant_tokens`].
        lookup_ngram_size: prompt lookup beside the drafter, n-grams of this many tokens down to 2; 0: off
            [`max_matching_ngram_size`; `prompt_lookup_num_tokens=0`: off].
        schedule: "goodput" (each step's width chosen, 0 included) or "fixed" (k, or the drafts above
            `confidence_threshold`) [`num_assistant_tokens_schedule`: "heuristic", "constant"].
        confidence_threshold: with "fixed", the least cumulative draft probability verified
            [`assistant_confidence_threshold`].
        step_costs: the goodput scheduler's `StepCosts` (None: those this process learnt on the target so far).
        suffix_index: suffix drafts from this `SuffixIndex`, which also receives the call's rows (True: this call's).
        max_batch_size: the most rows decoded at once; the others join as rows finish (None: every row).
        memory_budget: bytes the decoding rows' caches, logits and prefill states may take (None: no budget).
        compaction_hole_fraction: compact the caches when rejected columns reach this share (0: every step).
        kernel_backend: one of `KERNEL_BACKENDS` (None: `$HF_SPECFORMER_KERNELS`, else "auto": Triton on CUDA).
    """

    num_draft_tokens: int | None = None
    lookup_ngram_size: int = 4
    schedule: str = "goodput"
    confidence_threshold: float = 0.0
    step_costs: StepCosts | None = None
    suffix_index: SuffixIndex | bool | None = None
    max_batch_size: int | None = None
    memory_budget: int | None = None
    compaction_hole_fraction: float = 0.5
    kernel_backend: str | None = None

    def __post_init__(self):
        for name in ("num_draft_tokens", "lookup_ngram_size", "max_batch_size", "memory_budget"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int, got {value!r}.")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens} must be at least 0 (0: plain decoding).")
        if self.lookup_ngram_size < 0 or self.lookup_ngram_size == 1:
            raise ValueError(f"lookup_ngram_size={self.lookup_ngram_size} must be 0 (off) or at least 2.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} must be one of {SCHEDULES}.")
        if not 0 <= self.confidence_threshold <= 1:
            raise ValueError(f"confidence_threshold={self.confidence_threshold} must be between 0 and 1.")
        if self.schedule == "goodput" and self.confidence_threshold > 0:
            raise ValueError("confidence_threshold applies to schedule='fixed'; the goodput scheduler sets its own.")
        if self.step_costs is not None and not isinstance(self.step_costs, StepCosts):
            raise TypeError(f"step_costs must be a StepCosts, got {type(self.step_costs).__name__}.")
        if self.suffix_index not in (None, True, False) and not isinstance(self.suffix_index, SuffixIndex):
            raise TypeError(f"suffix_index must be a SuffixIndex, True or None, got {self.suffix_index!r}.")
        for name in ("max_batch_size", "memory_budget"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive int (None: no limit).")
        if not self.compaction_hole_fraction >= 0:
            raise ValueError(f"compaction_hole_fraction={self.compaction_hole_fraction} must be at least 0.")
        if self.kernel_backend not in (None, *KERNEL_BACKENDS):
            raise ValueError(f"kernel_backend={self.kernel_backend!r} must be one of {KERNEL_BACKENDS}.")

    def slots(self, num_rows: int, slot_bytes: int) -> int:
        """Rows decoded at once in a call of `num_rows` rows whose slot takes `slot_bytes` of `memory_budget`."""
        slots = num_rows if self.max_batch_size is None else min(num_rows, self.max_batch_size)
        if self.memory_budget is None:
            return slots
        if self.memory_budget < slot_bytes:
            raise ValueError(f"memory_budget={self.memory_budget} bytes holds no row: one takes {slot_bytes} bytes "
                             "(its caches, logits and prefill states).")
        return min(slots, self.memory_budget // slot_bytes)

    @classmethod
    def resolve(cls, given: "SpeculationConfig | dict | None", config: GenerationConfig) -> "SpeculationConfig":
        """`given` completed from transformers' names in `config`; ValueError where they disagree."""
        if isinstance(given, dict):
            unknown = set(given) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise TypeError(f"speculation_config has no fields {sorted(unknown)}.")
            given = cls(**given)
        given = given or cls()
        theirs = {"num_draft_tokens": config.num_assistant_tokens,
                  "confidence_threshold": config.assistant_confidence_threshold,
                  "lookup_ngram_size": config.max_matching_ngram_size,
                  "schedule": TRANSFORMERS_SCHEDULES.get(config.num_assistant_tokens_schedule)}
        if config.prompt_lookup_num_tokens is not None:
            if config.prompt_lookup_num_tokens == 0:
                theirs["lookup_ngram_size"] = 0
            elif theirs["num_draft_tokens"] not in (None, config.prompt_lookup_num_tokens):
                raise ValueError(f"prompt_lookup_num_tokens={config.prompt_lookup_num_tokens} and num_assistant_tokens="
                                 f"{theirs['num_draft_tokens']} disagree: lookup and the drafter propose the same k.")
            else:
                theirs["num_draft_tokens"] = config.prompt_lookup_num_tokens
        if theirs["confidence_threshold"] and theirs["schedule"] is None and given.schedule == "goodput":
            theirs["schedule"] = "fixed"
        defaults, changes = cls(), {}
        for name, value in theirs.items():
            ours = getattr(given, name)
            if value is None or value == ours:
                continue
            if ours != getattr(defaults, name):
                raise ValueError(f"{name}={ours!r} disagrees with transformers' equivalent ({value!r}); pass one.")
            changes[name] = value
        return dataclasses.replace(given, **changes)
