"""`generate` with a SpecFormer drafter: batched, lossless speculative decoding inside `transformers`' `generate`.

Two ways in, same function:

    out = target.generate(**inputs, assistant_model=draft, custom_generate=drafter_dir, trust_remote_code=True)
    out = hf_specformer.generate(target, **inputs, assistant_model=draft)

This file is the drafter folder's `custom_generate/generate.py` (bundled with its sibling modules), so it imports
only torch, transformers (and numpy, which transformers requires) and siblings. Arguments beyond `generate`'s:
    assistant_model: a SpecFormer drafter (bound to `model` here if it is not yet) or a `Proposer`.
    num_draft_tokens: k, drafts per step (default: the drafter's `config.num_speculative_tokens`).
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
        measured once per model, dtype, device and drafter and cached under `$HF_SPECFORMER_CACHE`.
    confidence_threshold: with `schedule="fixed"`, a row verifies its drafts while their cumulative draft
        probability is at least this (default 0: all k; looked-up drafts count as certain).
Outputs are those of `generate`; with `return_dict_in_generate=True` the output also has `speculation_stats`
(`SpecStats`: steps, tokens per step per row, acceptance per drafted position, widths chosen, predicted vs
realised acceptance). After every call the same statistics are on the assistant as
`assistant_model.speculation_stats`.
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig, GenerationMixin

from .drafting import PromptLookupProposer, Proposer, SpecFormerProposer
from .engine import COMPACTION_HOLE_FRACTION, speculative_decode
from .scheduling import CONFIDENCE_THRESHOLD

UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")

LOOKUP_NGRAM_SIZE = 4
"""Default longest n-gram of prompt lookup (see `PromptLookupProposer` for the measurement behind it)."""


def _make_proposer(model, assistant_model, num_draft_tokens: int | None, lookup_ngram_size: int) -> Proposer:
    """The proposer behind `assistant_model`, bound to `model` and checked against it, with prompt lookup on top
    when `lookup_ngram_size` > 0 (unless it is a `PromptLookupProposer` already)."""
    proposer = _assistant_proposer(model, assistant_model, num_draft_tokens)
    if not lookup_ngram_size or isinstance(proposer, PromptLookupProposer):
        return proposer
    return PromptLookupProposer(proposer, lookup_ngram_size)


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


def _acceptance_table(assistant_model, companion_model) -> dict | None:
    """The calibrated table the estimator starts from: the companion's (S, A) table, or the drafter's confidence
    table; None when the model carries none."""
    source = companion_model if companion_model is not None else assistant_model
    return getattr(getattr(source, "config", None), "acceptance_table", None)


def _check_arguments(model, inputs, generation_config, streamer, kwargs) -> None:
    """Clear errors for what speculative generation does not do, before any work."""
    config = copy.deepcopy(generation_config or model.generation_config)
    unused = config.update(**kwargs)
    if (config.num_beams or 1) > 1:
        raise ValueError("Speculative generation does not support beam search (`num_beams > 1`).")
    if (config.num_return_sequences or 1) > 1 and not config.do_sample:
        raise ValueError("`num_return_sequences > 1` needs `do_sample=True`: greedy rows would be identical.")
    if config.cache_implementation not in (None, "dynamic") or unused.get("past_key_values") is not None:
        raise ValueError(
            f"Speculative generation manages its own DynamicCache; got cache_implementation="
            f"{config.cache_implementation!r}{' and past_key_values' if unused.get('past_key_values') else ''}."
        )
    requested = [name for name in UNSUPPORTED_OUTPUTS if getattr(config, name, False)]
    if requested:
        raise ValueError(f"Speculative generation returns sequences and statistics only; unsupported: {requested}.")
    input_ids = inputs if inputs is not None else unused.get("input_ids")
    if input_ids is None:
        raise ValueError("Pass `input_ids` (or `inputs`): speculative generation needs a prompt.")
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("A streamer needs batch size 1.")
    pad_token_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    if isinstance(pad_token_id, list):
        pad_token_id = pad_token_id[0]
    if unused.get("attention_mask") is None and input_ids.shape[0] > 1 and pad_token_id is not None:
        if bool((input_ids[:, 0] == pad_token_id).any()):
            raise ValueError(
                "The batch looks left-padded but no `attention_mask` was given: pass the tokenizer's attention_mask."
            )


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
    lookup_ngram_size: int = LOOKUP_NGRAM_SIZE,
    compaction_hole_fraction: float = COMPACTION_HOLE_FRACTION,
    confidence_threshold: float = CONFIDENCE_THRESHOLD,
    schedule: str | None = None,
    companion_model=None,
    step_costs=None,
    **kwargs,
):
    """Speculative `generate` for `model` (the target) with `assistant_model` drafting; see the module docstring."""
    if prefix_allowed_tokens_fn is not None or negative_prompt_ids is not None:
        raise ValueError("`prefix_allowed_tokens_fn` and negative prompts are not supported with speculation.")
    if not 0 <= confidence_threshold <= 1:
        raise ValueError(f"confidence_threshold={confidence_threshold} must be between 0 and 1.")
    schedule = schedule or ("fixed" if confidence_threshold > 0 else "goodput")
    proposer = _make_proposer(model, assistant_model, num_draft_tokens, lookup_ngram_size)
    companion = _bind_companion(model, companion_model)
    _check_arguments(model, inputs, generation_config, streamer, kwargs)
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
        compaction_hole_fraction=compaction_hole_fraction,
        confidence_threshold=confidence_threshold,
        schedule=schedule,
        step_costs=step_costs,
        companion=companion,
        acceptance_table=_acceptance_table(assistant_model, companion) if schedule == "goodput" else None,
        **kwargs,
    )
    if assistant_model is not proposer:
        assistant_model.speculation_stats = proposer.stats
    return result
