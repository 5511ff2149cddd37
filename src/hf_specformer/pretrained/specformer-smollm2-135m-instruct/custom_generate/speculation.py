"""The speculation settings of one call, validated once: `SpeculationConfig`.

`generate` builds it from its own arguments and from transformers' assisted-generation names (passed to `generate`
or set in a `GenerationConfig`), and passes it down to the engine; nothing below re-checks it.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import GenerationConfig

from .costs import StepCostModel
from .scheduling import CONFIDENCE_THRESHOLD
from .verification import KERNEL_BACKENDS

LOOKUP_NGRAM_SIZE = 4
"""Default longest n-gram of prompt lookup (see `PromptLookupProposer` for the measurement behind it)."""

COMPACTION_HOLE_FRACTION = 0.5
"""Default share of cache columns that compaction would remove (holes of rejected drafts or padding shared by every
row) at which the caches are compacted."""

SCHEDULES = ("goodput", "fixed")
"""`schedule=` values: the goodput scheduler, or every row verifying k drafts (or up to `confidence_threshold`)."""

TRANSFORMERS_NAMES = ("num_assistant_tokens", "assistant_confidence_threshold", "max_matching_ngram_size",
                      "prompt_lookup_num_tokens", "num_assistant_tokens_schedule")
"""transformers' assisted-generation arguments that `SpeculationConfig.from_arguments` reads."""

TRANSFORMERS_SCHEDULES = {"constant": "fixed", "heuristic": "goodput", "heuristic_transient": "goodput"}


@dataclass(frozen=True)
class SpeculationConfig:
    """How one call speculates (the arguments of `generate` beyond transformers'; see its module docstring).

    Attributes:
        num_draft_tokens: k, drafts per row and step (None: the drafter's `num_speculative_tokens`; 0: plain).
        lookup_ngram_size: the longest n-gram of prompt lookup on top of the drafter (0: off).
        compaction_hole_fraction: compact the caches when the columns compaction would remove reach this share of
            their columns (0: every step, above 1: never).
        confidence_threshold: with the fixed schedule, a row verifies its drafts while their cumulative probability
            is at least this (0: all k).
        schedule: "goodput" or "fixed" (`scheduling.py`).
        step_costs: the goodput scheduler's `StepCostModel` (or its dict, or a saved file); None: those cached for
            this machine, else learnt from the call's own steps.
        cpu_speedups: on a CPU target, the loop's few-row products and grouped-query attention.
        packed_verification: a step's linear layers compute only the inputs it verifies, and a prefill's only the
            real prompt tokens (`linears.py`).
        cost_feedback: the goodput scheduler learns step costs from the call's steps and hands a losing call over
            to plain steps (`feedback.py`).
        kernel_backend: verification's kernels, one of `KERNEL_BACKENDS` (None: `HF_SPECFORMER_KERNELS`).
        max_batch_size: the most rows decoded at once (None: all of the call's); the others wait and join as
            running rows finish (continuous batching, `admission.py`).
        memory_budget: bytes the decoding rows' state may take (caches, vocabulary-wide tensors, prefill states;
            `admission.slot_bytes`); the slots are then at most as many as fit. None: no budget.
        alternative_draft: n > 0 (True: 1): each step that verifies drafts also verifies branches of n inputs,
            each one of slot 1's next-best tokens then the drafts of slots 2 .. n (`alternatives.py`; greedy only).
        num_alternatives: c >= 1, the branches with `alternative_draft` (slot 1's 2nd .. (c + 1)-th best tokens).
    """

    num_draft_tokens: int | None = None
    lookup_ngram_size: int = LOOKUP_NGRAM_SIZE
    compaction_hole_fraction: float = COMPACTION_HOLE_FRACTION
    confidence_threshold: float = CONFIDENCE_THRESHOLD
    schedule: str = "goodput"
    step_costs: StepCostModel | dict | str | None = None
    cpu_speedups: bool = True
    packed_verification: bool = True
    cost_feedback: bool = True
    kernel_backend: str | None = None
    max_batch_size: int | None = None
    memory_budget: int | None = None
    alternative_draft: int = 0
    num_alternatives: int = 1

    def __post_init__(self):
        for name in ("num_draft_tokens", "lookup_ngram_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int, got {value!r}.")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens} must be at least 0 (0: plain decoding).")
        if self.lookup_ngram_size < 0:
            raise ValueError(f"lookup_ngram_size={self.lookup_ngram_size} must be 0 (off) or at least 2.")
        if not self.compaction_hole_fraction >= 0:
            raise ValueError(f"compaction_hole_fraction={self.compaction_hole_fraction} must be at least 0 "
                             "(0: every step, above 1: never).")
        if not 0 <= self.confidence_threshold <= 1:
            raise ValueError(f"confidence_threshold={self.confidence_threshold} must be between 0 and 1.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} must be one of {SCHEDULES}.")
        if self.schedule == "goodput" and self.confidence_threshold > 0:
            raise ValueError("confidence_threshold applies to schedule='fixed'; the goodput scheduler sets its own.")
        if self.kernel_backend not in (None, *KERNEL_BACKENDS):
            raise ValueError(f"kernel_backend={self.kernel_backend!r} must be one of {KERNEL_BACKENDS}.")
        if not isinstance(self.alternative_draft, int) or self.alternative_draft < 0:
            raise ValueError(f"alternative_draft={self.alternative_draft!r} must be an int >= 0 (True: 1, 0: off).")
        if isinstance(self.num_alternatives, bool) or not isinstance(self.num_alternatives, int) \
                or self.num_alternatives < 1:
            raise ValueError(f"num_alternatives={self.num_alternatives!r} must be an int >= 1.")
        for name in ("max_batch_size", "memory_budget"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int (None: no limit).")

    def slots(self, num_rows: int, slot_bytes: int) -> int:
        """Rows decoded at once in a call of `num_rows` rows, a slot taking `slot_bytes` of `memory_budget`."""
        slots = num_rows if self.max_batch_size is None else min(num_rows, self.max_batch_size)
        if self.memory_budget is None:
            return slots
        if self.memory_budget < slot_bytes:
            raise ValueError(f"memory_budget={self.memory_budget} bytes holds no row: one takes {slot_bytes} bytes "
                             "(its caches, logits and prefill states; `admission.slot_bytes`).")
        return min(slots, self.memory_budget // slot_bytes)

    @classmethod
    def from_arguments(
        cls, config: GenerationConfig, num_draft_tokens: int | None = None, lookup_ngram_size: int | None = None,
        confidence_threshold: float | None = None, schedule: str | None = None, **others,
    ) -> "SpeculationConfig":
        """Our arguments, completed from transformers' names found in the resolved `config`: num_assistant_tokens
        -> num_draft_tokens, assistant_confidence_threshold -> confidence_threshold (with the fixed schedule),
        max_matching_ngram_size -> lookup_ngram_size, prompt_lookup_num_tokens -> lookup on (0: off) and k,
        num_assistant_tokens_schedule "constant" -> schedule "fixed", "heuristic"/"heuristic_transient" ->
        "goodput". ValueError where both names are given and disagree. Without a schedule: "fixed" with a
        confidence threshold, else "goodput". `others`: the remaining fields, as they are."""
        ours = {"num_draft_tokens": num_draft_tokens, "lookup_ngram_size": lookup_ngram_size,
                "confidence_threshold": confidence_threshold, "schedule": schedule}
        lookup_tokens, their_k = config.prompt_lookup_num_tokens, config.num_assistant_tokens
        if lookup_tokens:
            if their_k not in (None, lookup_tokens):
                raise ValueError(f"prompt_lookup_num_tokens={lookup_tokens} and num_assistant_tokens={their_k} "
                                 "disagree: lookup and the drafter propose the same k drafts.")
            their_k = lookup_tokens
        theirs = {
            "num_draft_tokens": their_k,
            "lookup_ngram_size": 0 if lookup_tokens == 0 else config.max_matching_ngram_size,
            "confidence_threshold": config.assistant_confidence_threshold,
            "schedule": TRANSFORMERS_SCHEDULES.get(config.num_assistant_tokens_schedule),
        }
        for name, value in theirs.items():
            if value is None:
                continue
            if ours[name] is not None and ours[name] != value:
                raise ValueError(f"{name}={ours[name]!r} disagrees with transformers' equivalent ({value!r}); pass one.")
            ours[name] = value
        threshold = CONFIDENCE_THRESHOLD if ours["confidence_threshold"] is None else ours["confidence_threshold"]
        return cls(
            num_draft_tokens=ours["num_draft_tokens"],
            lookup_ngram_size=LOOKUP_NGRAM_SIZE if ours["lookup_ngram_size"] is None else ours["lookup_ngram_size"],
            confidence_threshold=threshold,
            schedule=ours["schedule"] or ("fixed" if threshold > 0 else "goodput"),
            **others,
        )
