"""`generate` with a SpecFormer drafter: batched, lossless speculative decoding inside `transformers`' `generate`.

Two ways in, same function:

    out = target.generate(**inputs, assistant_model=draft, custom_generate=drafter_dir, trust_remote_code=True)
    out = hf_specformer.generate(target, **inputs, assistant_model=draft)

This file is the drafter folder's `custom_generate/generate.py` (bundled with its sibling modules), so it imports
only torch, transformers (and numpy, which transformers requires) and siblings. Arguments beyond `generate`'s:
    model: the target, a causal LM or a PEFT model of one (a LoRA-adapted target runs with its adapters).
    assistant_model: a SpecFormer drafter (bound to `model` here if it is not yet) or a `Proposer`.
    num_draft_tokens: k, drafts per step (default: the drafter's `config.num_speculative_tokens`; 0: plain
        decoding, transformers' own loop, or with `max_batch_size` plain steps in the engine's continuous batching).
    lookup_ngram_size: add prompt lookup (`PromptLookupProposer`): where a row's last n committed tokens (n = this
        down to 2) occurred earlier in the row, the tokens that followed them are the drafts. 0 turns it off.
    compaction_hole_fraction: squeeze rejected/padding columns out of the caches once they are this share of the
        columns (default 0.5; above 1 never).
    schedule: "goodput" (default: Speculative Verification's goodput scheduler picks each step's width, 0 included,
        against step costs measured on this machine) or "fixed" (every row verifies k drafts). See `scheduling.py`.
    companion_model: a `CompanionForVerification` (bound to `model` here if it is not yet): the goodput scheduler
        then estimates acceptance from SV's (S, A) signals through the companion's calibrated table; without one
        it uses the drafter's own confidence (through the drafter's table, when calibrated).
    step_costs: the goodput scheduler's step costs (`StepCostModel`, its dict, or a saved JSON file); default:
        those cached under `$HF_SPECFORMER_CACHE` for this model, dtype, device and drafter, if any.
    cost_feedback: the goodput scheduler corrects the step costs from the call's own timed steps and hands a call
        that falls behind plain decoding over to plain steps (`feedback.py`; default True). Step choices then
        depend on timings, so seeded sampling is reproducible in distribution only; False keeps the given costs
        (choices, and seeded samples, repeat exactly).
    cpu_speedups: on a CPU target, the loop's few-row matrix products and grouped-query attention
        (`linears.py`, `attention.py`; default True). Never applied on GPUs.
    packed_verification: a step's linear layers compute only the inputs it verifies, the prefill's only the real
        prompt tokens, and the goodput scheduler picks (row, draft) pairs by their cost in inputs (`linears.py`;
        default True); False: padded steps and prefills.
    confidence_threshold: with `schedule="fixed"`, a row verifies its drafts while their cumulative draft
        probability is at least this (default 0: all k; looked-up drafts count as certain).
    kernel_backend: verification's kernels: "auto" (Triton on CUDA), "triton" or "torch" (`hf_specformer.kernels`;
        default: `$HF_SPECFORMER_KERNELS`, else "auto").
    suffix_index: add cross-request suffix drafts (`suffix.py`): where a row's last 4 committed tokens occurred in
        the batch's rows or in the `SuffixIndex`'s earlier requests, their most frequent continuation drafts, with
        its frequency as confidence; prompt lookup's drafts go first. A `SuffixIndex` also receives the call's rows
        (prompts and outputs) at the end, for later calls; True: a fresh one for this call only. Default None: off.
    max_batch_size: the most rows decoded at once (default None: every row). The other rows wait and join the
        running batch as rows finish, each with a prefill of its own (continuous batching, `admission.py`), so a
        call over many prompts keeps its slots busy and its caches at `max_batch_size` rows. Outputs are those of
        the whole batch, as `generate` returns them.
    memory_budget: bytes the decoding rows' state may take (their cache columns, vocabulary-wide tensors and prefill
        states: `admission.slot_bytes`); the rows decoded at once are then at most as many as fit, the others wait
        as with `max_batch_size`. ValueError if not even one row fits. Default None: no budget.
    row_finished: called with a `FinishedRow` (row index, generated tokens, steps, accepted drafts) as each row
        ends, so that a caller can use a row's answer before the call returns (`finishing.py`). Default None.
    alternative_draft: n > 0 (True: 1): each step that verifies drafts also verifies branches of n inputs, each
        one of the drafter's next-best first drafts then its drafts for slots 2 .. n (a draft tree,
        `alternatives.py`): where the first draft is rejected and an alternative is the target's token, its
        branch is verified like a chain. Greedy decoding only (ValueError with sampling, with logits processors
        that read the prefix, or with attention other than `sdpa`/`eager`). Default 0: off.
    num_alternatives: the branches, with `alternative_draft`: slot 1's 2nd .. (c + 1)-th best tokens. Default 1.
    sampling_seeds: one int per row (after `num_return_sequences`), with `do_sample=True`: each row's text then
        depends only on its seed, prompt and the model, not on its batch or its drafts (`seeding.py`: Gumbel-max
        sampling with per-row noise, verified greedily); the call always runs the engine. Default None: torch's
        generator, rejection sampling.
transformers' names are accepted too, as arguments or in a `GenerationConfig`: `num_assistant_tokens` (k),
`assistant_confidence_threshold`, `max_matching_ngram_size` (lookup n-gram), `prompt_lookup_num_tokens` (lookup
on, k; 0: off) and `num_assistant_tokens_schedule` ("constant": fixed, "heuristic": goodput).
Outputs are those of `generate`; with `return_dict_in_generate=True` the output also has `speculation_stats`
(`SpecStats`: steps, tokens per step per row, acceptance per drafted position, widths chosen, predicted vs
realised acceptance); nothing is stored on the models.
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig, GenerationMixin, StoppingCriteriaList, StopStringCriteria

from .drafting import PromptLookupProposer, Proposer, SpecFormerProposer
from .engine import speculative_decode
from .speculation import COMPACTION_HOLE_FRACTION, TRANSFORMERS_NAMES, SpeculationConfig
from .suffix import SuffixIndex, SuffixProposer
from .validation import (
    check_arguments,
    check_cache_layers,
    check_logits_processors,
    check_prompt,
    max_new_tokens,
    resolved_config,
    resolved_pad_token_id,
)

def _make_proposer(model, assistant_model, num_draft_tokens: int | None, lookup_ngram_size: int,
                   suffix_index: SuffixIndex | None) -> Proposer:
    """The proposer behind `assistant_model`, bound to `model` and checked against it, with prompt lookup on top
    when `lookup_ngram_size` > 0 and suffix drafts from `suffix_index` on top of that (a given `PromptLookupProposer`
    or `SuffixProposer` is used as it is)."""
    proposer = _assistant_proposer(model, assistant_model, num_draft_tokens)
    if not proposer.num_draft_tokens:
        return proposer
    if lookup_ngram_size and not isinstance(proposer, (PromptLookupProposer, SuffixProposer)):
        proposer = PromptLookupProposer(proposer, lookup_ngram_size)
    if suffix_index is None or isinstance(proposer, SuffixProposer):
        return proposer
    return SuffixProposer(proposer, suffix_index)


def _suffix_index(suffix_index) -> SuffixIndex | None:
    """`generate`'s `suffix_index` argument -> the index (True: a fresh one, for this call's rows only)."""
    if suffix_index is None or suffix_index is False:
        return None
    if suffix_index is True:
        return SuffixIndex(max_tokens=0)
    if not isinstance(suffix_index, SuffixIndex):
        raise TypeError(f"suffix_index must be a SuffixIndex, True or None, got {type(suffix_index).__name__}.")
    return suffix_index


def _assistant_proposer(model, assistant_model, num_draft_tokens: int | None) -> Proposer:
    if isinstance(assistant_model, Proposer):
        if num_draft_tokens not in (None, assistant_model.num_draft_tokens):
            raise ValueError(
                f"num_draft_tokens={num_draft_tokens} differs from the proposer's {assistant_model.num_draft_tokens}."
            )
        return assistant_model
    if assistant_model is None or getattr(assistant_model.config, "model_type", None) != "specformer":
        raise ValueError(
            "Speculative generation needs `assistant_model`: a SpecFormer drafter "
            "(`AutoModel.from_pretrained(drafter_dir, trust_remote_code=True)`) or a `Proposer`; got "
            f"{type(assistant_model).__name__}."
        )
    if assistant_model.is_bound and not assistant_model.is_bound_to(model):
        raise ValueError(
            "This drafter is bound to another target model; load a fresh copy or call "
            "`assistant_model.bind_target(target)` for this one."
        )
    if not assistant_model.is_bound:
        assistant_model.bind_target(model)
    if assistant_model.device != model.device:
        raise ValueError(f"Drafter on {assistant_model.device} but target on {model.device}: move them together.")
    return SpecFormerProposer(assistant_model, num_draft_tokens)


def _bind_companion(model, companion_model):
    """The companion, bound to `model` (checked like a drafter); None stays None."""
    if companion_model is None:
        return None
    if getattr(companion_model.config, "model_type", None) != "sv_companion":
        raise ValueError(
            f"`companion_model` must be a CompanionForVerification, got {type(companion_model).__name__}."
        )
    if companion_model.is_bound and not companion_model.is_bound_to(model):
        raise ValueError("This companion is bound to another target model; load a fresh copy for this one.")
    if not companion_model.is_bound:
        companion_model.bind_target(model)
    if companion_model.device != model.device:
        raise ValueError(f"Companion on {companion_model.device} but target on {model.device}: move them together.")
    return companion_model


def _unwrap_peft(model):
    """A PEFT `PeftModel` target -> its base model, whose layers carry the adapters (LoRA layers wrap the base
    layers in place), so the engine runs the adapted target; any other model is returned as is. (Duck-typed: this
    file may not import peft.)"""
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def _without(generation_config: GenerationConfig | None, kwargs: dict, names) -> GenerationConfig | None:
    """Removes `names` from `kwargs` (in place) and returns `generation_config` without them (a copy where it set
    any): arguments this function handles itself, which `GenerationMixin.generate` must not act on."""
    for name in names:
        kwargs.pop(name, None)
    if generation_config is not None and any(getattr(generation_config, name, None) is not None for name in names):
        generation_config = copy.deepcopy(generation_config)
        for name in names:
            setattr(generation_config, name, None)
    return generation_config


def _stop_string_criteria(config: GenerationConfig, generation_config, stopping_criteria, kwargs: dict):
    """`stop_strings` as a `StopStringCriteria` among the stopping criteria, and the configs without them:
    `GenerationMixin.generate` drops `tokenizer=` when the decoding method is a callable, so it could not build the
    criterion itself. Updates `kwargs` in place; returns (stopping_criteria, generation_config)."""
    tokenizer = kwargs.pop("tokenizer", None)
    if not config.stop_strings:
        return stopping_criteria, generation_config
    if tokenizer is None:
        raise ValueError("stop_strings need the target's tokenizer: pass `tokenizer=`.")
    criterion = StopStringCriteria(tokenizer=tokenizer, stop_strings=config.stop_strings)
    return StoppingCriteriaList([*(stopping_criteria or []), criterion]), \
        _without(generation_config, kwargs, ["stop_strings"])


def _row_seeds(sampling_seeds, config: GenerationConfig, num_prompts: int, device) -> torch.LongTensor | None:
    """`sampling_seeds` -> `[B]` seeds on `device` (None stays None), checked against the rows the call decodes."""
    if sampling_seeds is None:
        return None
    if not config.do_sample:
        raise ValueError("sampling_seeds need do_sample=True (greedy decoding draws nothing).")
    seeds = torch.as_tensor(sampling_seeds, device=device)
    rows = num_prompts * (config.num_return_sequences or 1)
    if seeds.dtype != torch.long or seeds.shape != (rows,):
        raise ValueError(f"sampling_seeds must hold one int per row: {rows} (prompts x num_return_sequences), got "
                         f"{tuple(seeds.shape)} of {seeds.dtype}.")
    return seeds


def _acceptance_table(assistant_model, companion_model) -> dict | None:
    """The calibrated table the estimator starts from: the companion's (S, A) table, or the drafter's confidence
    table; None when the model carries none."""
    source = companion_model if companion_model is not None else assistant_model
    return getattr(getattr(source, "config", None), "acceptance_table", None)


@torch.no_grad()
def generate(
    model,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    logits_processor=None,
    stopping_criteria=None,
    prefix_allowed_tokens_fn=None,
    synced_gpus: bool | None = None,
    assistant_model=None,
    streamer=None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    num_draft_tokens: int | None = None,
    lookup_ngram_size: int | None = None,
    compaction_hole_fraction: float = COMPACTION_HOLE_FRACTION,
    confidence_threshold: float | None = None,
    schedule: str | None = None,
    companion_model=None,
    step_costs=None,
    cpu_speedups: bool = True,
    packed_verification: bool = True,
    cost_feedback: bool = True,
    kernel_backend: str | None = None,
    suffix_index: SuffixIndex | bool | None = None,
    max_batch_size: int | None = None,
    memory_budget: int | None = None,
    row_finished=None,
    sampling_seeds=None,
    alternative_draft: int = 0,
    num_alternatives: int = 1,
    **kwargs,
):
    """Speculative `generate` for `model` (the target) with `assistant_model` drafting; see the module docstring."""
    if prefix_allowed_tokens_fn is not None or negative_prompt_ids is not None:
        raise ValueError("`prefix_allowed_tokens_fn` and negative prompts are not supported with speculation.")
    model = _unwrap_peft(model)
    config, unused = resolved_config(model, generation_config, kwargs)
    speculation = SpeculationConfig.from_arguments(
        config, num_draft_tokens, lookup_ngram_size, confidence_threshold, schedule,
        compaction_hole_fraction=compaction_hole_fraction, step_costs=step_costs, cpu_speedups=cpu_speedups,
        packed_verification=packed_verification, cost_feedback=cost_feedback, kernel_backend=kernel_backend,
        max_batch_size=max_batch_size, memory_budget=memory_budget, alternative_draft=alternative_draft,
        num_alternatives=num_alternatives,
    )
    generation_config = _without(generation_config, kwargs, TRANSFORMERS_NAMES)
    input_ids = inputs if inputs is not None else unused.get("input_ids")
    if input_ids is None:
        raise ValueError("Pass `input_ids` (or `inputs`): speculative generation needs a prompt.")
    check_prompt(model, input_ids, unused.get("attention_mask"))
    check_arguments(model, config, unused, input_ids, streamer, synced_gpus)
    check_logits_processors(logits_processor)
    suffix_index = _suffix_index(suffix_index)
    proposer = _make_proposer(
        model, assistant_model, speculation.num_draft_tokens, speculation.lookup_ngram_size, suffix_index
    )
    check_cache_layers(model, input_ids.shape[1], max_new_tokens(config, input_ids.shape[1]), proposer.num_draft_tokens)
    companion = _bind_companion(model, companion_model)
    seeds = _row_seeds(sampling_seeds, config, input_ids.shape[0], model.device)
    stopping_criteria, generation_config = _stop_string_criteria(config, generation_config, stopping_criteria, kwargs)
    result = GenerationMixin.generate(
        model,
        inputs,
        generation_config=generation_config,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        synced_gpus=synced_gpus,
        custom_generate=speculative_decode,
        proposer=proposer,
        speculative_streamer=streamer,
        speculation=speculation,
        companion=companion,
        acceptance_table=_acceptance_table(assistant_model, companion) if speculation.schedule == "goodput" else None,
        row_finished=row_finished,
        seeds=seeds,
        **kwargs,
    )
    if suffix_index is not None:
        sequences = result if isinstance(result, torch.Tensor) else result.sequences
        suffix_index.add_generated(sequences, unused.get("attention_mask"), input_ids.shape[1],
                                   resolved_pad_token_id(config))
    return result
