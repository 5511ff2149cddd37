"""`generate` with a SpecFormer drafter: batched, lossless speculative decoding inside `transformers`' `generate`.

    out = target.generate(**inputs, assistant_model=draft, custom_generate=drafter_dir, trust_remote_code=True)
    out = hf_specformer.generate(target, **inputs, assistant_model=draft)

Takes `generate`'s arguments (transformers' assisted-generation names included) and four of its own:
`companion_model`, `speculation_config`, `sampling_seeds` and `row_finished` (see `generate`).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from transformers import GenerationMixin, StoppingCriteriaList, StopStringCriteria

from .engine import speculative_decode
from .proposers import NoDrafts, PromptLookupProposer, Proposer, SpecFormerProposer
from .speculation import TRANSFORMERS_NAMES, SpeculationConfig
from .suffix import SuffixIndex, SuffixProposer
from .validation import (check_arguments, check_cache_layers, check_logits_processors, check_prompt, max_new_tokens,
                         resolved_config, resolved_pad_token_id)


def _bound(model, helper, model_type: str, argument: str):
    """`helper` (a drafter or companion) bound to `model`, or ValueError saying what to pass instead."""
    if getattr(getattr(helper, "config", None), "model_type", None) != model_type:
        raise ValueError(f"`{argument}` must be a {model_type} model (`AutoModel.from_pretrained(dir, "
                         f"trust_remote_code=True)`) or, for `assistant_model`, a `Proposer`; got "
                         f"{type(helper).__name__}.")
    if helper.is_bound and not helper.is_bound_to(model):
        raise ValueError(f"This {argument} is bound to another target model; load a fresh copy for this one.")
    if not helper.is_bound:
        helper.bind_target(model)
    if helper.device != model.device:
        raise ValueError(f"{argument} on {helper.device} but the target on {model.device}: move them together.")
    return helper


def _proposer(model, assistant_model, speculation: SpeculationConfig, suffix_index: SuffixIndex | None) -> Proposer:
    """The proposer behind `assistant_model`, with prompt lookup and suffix drafts on top where asked for."""
    k = speculation.num_draft_tokens
    if k == 0:
        return NoDrafts()
    if isinstance(assistant_model, Proposer):
        if k not in (None, assistant_model.num_draft_tokens):
            raise ValueError(f"num_draft_tokens={k} differs from the proposer's {assistant_model.num_draft_tokens}.")
        proposer = assistant_model
    else:
        proposer = SpecFormerProposer(_bound(model, assistant_model, "specformer", "assistant_model"), k)
    if not proposer.num_draft_tokens:
        return proposer
    if speculation.lookup_ngram_size and not isinstance(proposer, (PromptLookupProposer, SuffixProposer)):
        proposer = PromptLookupProposer(proposer, speculation.lookup_ngram_size)
    return proposer if suffix_index is None else SuffixProposer(proposer, suffix_index)


def _unwrap_peft(model):
    """A PEFT `PeftModel` -> its base model, whose layers carry the adapters (duck-typed: no peft import here)."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


def _row_seeds(sampling_seeds, config, num_prompts: int, device):
    """`sampling_seeds` -> `[B]` seeds (None stays None), checked against the rows the call decodes."""
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


def _without(generation_config, kwargs: dict, names):
    """Removes `names`, handled here, from `kwargs` (in place) and from a copy of `generation_config`."""
    for name in names:
        kwargs.pop(name, None)
    if generation_config is not None and any(getattr(generation_config, name, None) is not None for name in names):
        generation_config = copy.deepcopy(generation_config)
        for name in names:
            setattr(generation_config, name, None)
    return generation_config


@torch.no_grad()
def generate(model, inputs: torch.Tensor | None = None, generation_config=None, logits_processor=None,
             stopping_criteria=None, prefix_allowed_tokens_fn=None, synced_gpus: bool | None = None,
             assistant_model=None, streamer=None, negative_prompt_ids=None, negative_prompt_attention_mask=None,
             companion_model=None, speculation_config: SpeculationConfig | dict | None = None, sampling_seeds=None,
             row_finished=None, **kwargs):
    """Speculative `generate` for `model` (the target, or a PEFT model of one); `generate`'s arguments, and:

    Args:
        assistant_model: a SpecFormer drafter (bound to `model`) or a `Proposer`.
        companion_model: a `CompanionForVerification`, whose (S, A) signals the goodput scheduler reads.
        speculation_config: a `SpeculationConfig` or a dict of its fields.
        sampling_seeds: one int per row: a row's sampled text then depends only on its seed.
        row_finished: called with a `FinishedRow` as each row ends (a `RowFeed` keeps the call running).
    Returns what `generate` returns; a dict output's `speculation_stats` is a `SpecStats`.
    """
    if prefix_allowed_tokens_fn is not None or negative_prompt_ids is not None:
        raise ValueError("`prefix_allowed_tokens_fn` and negative prompts are not supported with speculation.")
    fields = [name for name in kwargs if name in {f.name for f in dataclasses.fields(SpeculationConfig)}]
    if fields:
        raise TypeError(f"{fields[0]} is a SpeculationConfig field: pass speculation_config={{{fields[0]!r}: ...}} "
                        "(or transformers' name where it has one).")
    model = _unwrap_peft(model)
    config, unused = resolved_config(model, generation_config, kwargs)
    speculation = SpeculationConfig.resolve(speculation_config, config)
    generation_config = _without(generation_config, kwargs, TRANSFORMERS_NAMES)
    input_ids = inputs if inputs is not None else unused.get("input_ids")
    if input_ids is None:
        raise ValueError("Pass `input_ids` (or `inputs`): speculative generation needs a prompt.")
    check_prompt(model, input_ids, unused.get("attention_mask"))
    check_arguments(model, config, unused, input_ids, streamer, synced_gpus)
    check_logits_processors(logits_processor)
    suffix_index = None if speculation.suffix_index is False else speculation.suffix_index
    suffix_index = SuffixIndex(max_tokens=0) if suffix_index is True else suffix_index
    proposer = _proposer(model, assistant_model, speculation, suffix_index)
    check_cache_layers(model, input_ids.shape[1], max_new_tokens(config, input_ids.shape[1]), proposer.num_draft_tokens)
    companion = None if companion_model is None else _bound(model, companion_model, "sv_companion", "companion_model")
    if companion is not None and speculation.schedule != "goodput":
        raise ValueError("A companion model serves the goodput scheduler only (schedule='goodput').")
    tables = [getattr(getattr(m, "config", None), "acceptance_table", None) for m in (companion, assistant_model)]
    table = tables[0] if companion is not None else tables[1]
    stop_tokenizer = kwargs.pop("tokenizer", None)
    if config.stop_strings:
        if stop_tokenizer is None:
            raise ValueError("stop_strings need the target's tokenizer: pass `tokenizer=`.")
        criterion = StopStringCriteria(tokenizer=stop_tokenizer, stop_strings=config.stop_strings)
        stopping_criteria = StoppingCriteriaList([*(stopping_criteria or []), criterion])
        generation_config = _without(generation_config, kwargs, ["stop_strings"])
    result = GenerationMixin.generate(
        model, inputs, generation_config=generation_config, logits_processor=logits_processor,
        stopping_criteria=stopping_criteria, synced_gpus=synced_gpus, custom_generate=speculative_decode,
        proposer=proposer, speculation=speculation, companion=companion, acceptance_table=table,
        speculative_streamer=streamer, row_finished=row_finished,
        seeds=_row_seeds(sampling_seeds, config, input_ids.shape[0], model.device), **kwargs,
    )
    if suffix_index is not None:
        sequences = result if isinstance(result, torch.Tensor) else result.sequences
        suffix_index.add_generated(sequences, unused.get("attention_mask"), input_ids.shape[1],
                                   resolved_pad_token_id(config))
    return result
