"""Checks of a speculative `generate` call, before any work: what plain `generate` would reject deep inside or
silently mis-generate, and what speculation cannot serve exactly, gets an error that says what to fix.

Sliding windows count cache columns, holes included, so such a target is served only while its window cannot bite;
other layer kinds (linear attention, recurrent states) cannot be rolled back past rejected drafts.
"""

from __future__ import annotations

import copy
import inspect

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""`layer_types` entries whose KV cache the engine can keep holes in (the windowed ones under the bound above)."""


def resolved_config(model, generation_config: GenerationConfig | None, kwargs: dict) -> tuple[GenerationConfig, dict]:
    """The generation config `generate` will use (a copy, updated with `kwargs`) and the kwargs it does not take. The
    copy is shallow: `update` rebinds attributes, never changes the values they held."""
    config = copy.copy(generation_config or model.generation_config)
    unused = config.update(**kwargs)
    return config, unused


def check_prompt(model, input_ids, attention_mask) -> None:
    """input_ids `[B, P]` integer ids within the target's embedding rows, P >= 1; attention_mask None or `[B, P]`
    of 0/1, left padded (zeros then ones), at least one token per row."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}.")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids (torch.long), got dtype {input_ids.dtype}.")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [batch, length], got {tuple(input_ids.shape)} (one prompt: "
                         "input_ids[None]).")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids of shape {tuple(input_ids.shape)} is empty: every row needs at least one token.")
    num_embeddings = model.get_input_embeddings().num_embeddings
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= num_embeddings:
        raise ValueError(f"input_ids holds token id {low if low < 0 else high}; the target's ids are "
                         f"0..{num_embeddings - 1}. Was the prompt tokenized with this target's tokenizer?")
    if attention_mask is not None:
        _check_attention_mask(input_ids, attention_mask)


def _check_attention_mask(input_ids: torch.Tensor, attention_mask) -> None:
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}.")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids "
                         f"{tuple(input_ids.shape)}: pass the mask the tokenizer returned with these ids.")
    if not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token).")
    mask = attention_mask.long()
    empty = (mask.sum(1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"Rows {empty} of attention_mask are all padding: every row needs at least one token.")
    not_left_padded = (mask[:, 1:] < mask[:, :-1]).any(1).nonzero().flatten().tolist()
    if not_left_padded:
        raise ValueError(f"Rows {not_left_padded} are right padded (or have gaps): decoder-only generation needs left "
                         "padding; set `tokenizer.padding_side = 'left'` before tokenizing.")


def check_arguments(model, config: GenerationConfig, unused: dict, input_ids, streamer, synced_gpus) -> None:
    """What speculative generation does not do, with the resolved `config`; `unused`: kwargs the config left."""
    if synced_gpus:
        raise ValueError("synced_gpus=True (DeepSpeed ZeRO-3 / FSDP) is not supported: each process's speculative "
                         "loop takes its own number of steps, so the processes' forwards would not line up.")
    if config.use_cache is False:
        raise ValueError("Speculative generation needs use_cache=True: it verifies drafts against the KV cache.")
    if unused.get("inputs_embeds") is not None:
        raise ValueError("Speculative generation needs input_ids (the drafter and prompt lookup read the tokens), "
                         "not inputs_embeds.")
    if (config.num_beams or 1) > 1:
        raise ValueError("Speculative generation does not support beam search (`num_beams > 1`).")
    if (config.num_return_sequences or 1) > 1 and not config.do_sample:
        raise ValueError("`num_return_sequences > 1` needs `do_sample=True`: greedy rows would be identical.")
    if config.guidance_scale is not None and config.guidance_scale != 1:
        raise ValueError(f"guidance_scale={config.guidance_scale}: classifier-free guidance runs its own model calls, "
                         "one token per step, which speculation cannot replay; use plain `generate` for it.")
    given = [name for name in ("cache", "past_key_values") if unused.get(name) is not None]
    if config.cache_implementation not in (None, "dynamic") or given:
        raise ValueError(f"Speculative generation manages its own DynamicCache; got cache_implementation="
                         f"{config.cache_implementation!r}{''.join(f' and {name}' for name in given)}.")
    requested = [name for name in UNSUPPORTED_OUTPUTS if getattr(config, name, False)]
    if requested:
        raise ValueError(f"Speculative generation returns sequences and statistics only; unsupported: {requested}.")
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("A streamer needs batch size 1.")
    pad_token_id = resolved_pad_token_id(config)
    if unused.get("attention_mask") is None and pad_token_id is not None and input_ids.shape[0] > 1 and \
            bool((input_ids[:, 0] == pad_token_id).any()):
        raise ValueError("The batch looks left-padded but no `attention_mask` was given: pass the tokenizer's mask.")


def resolved_pad_token_id(config: GenerationConfig) -> int | None:
    """The token `generate` pads finished rows with: `pad_token_id`, else the (first) `eos_token_id`."""
    pad_token_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    return pad_token_id[0] if isinstance(pad_token_id, list) else pad_token_id


def check_logits_processors(logits_processor) -> None:
    """Rejects user processors that keep per-step state of their own (classifier-free guidance), and those that need
    arguments beyond `(input_ids, scores)`, which plain `generate` refuses at its first step."""
    for processor in logits_processor or []:
        if isinstance(processor, UnbatchedClassifierFreeGuidanceLogitsProcessor):
            raise ValueError(f"{type(processor).__name__} runs the model itself one token per step and cannot be used "
                             "with speculation.")
        if len(inspect.signature(processor.__call__).parameters) > 2:
            raise ValueError(f"{type(processor).__name__} needs arguments beyond (input_ids, scores), which generation "
                             "does not pass.")


def max_new_tokens(config: GenerationConfig, prompt_width: int) -> int:
    """New tokens the call may generate (`max_new_tokens`, else `max_length` minus the prompt, else transformers'
    default of 20 new tokens)."""
    if config.max_new_tokens is not None:
        return config.max_new_tokens
    return 20 if config.max_length is None else config.max_length - prompt_width


def check_cache_layers(model, prompt_width: int, new_tokens: int, num_draft_tokens: int) -> None:
    """Rejects targets whose cache the engine cannot serve exactly: other layer kinds than attention, and sliding
    windows that prompt width + max_new_tokens * (k + 1) columns (holes included) would exceed."""
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        layer_types = ["sliding_attention" if window is not None else "full_attention"]
    unsupported = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES))
    architecture = type(model).__name__
    if unsupported:
        raise ValueError(f"{architecture} has {unsupported} layers, whose state cannot be rolled back past rejected "
                         "drafts; speculative generation supports attention-only targets.")
    if set(layer_types) == {"full_attention"} or window is None:
        return
    columns = prompt_width + new_tokens * (num_draft_tokens + 1)
    if columns > window - 1:
        raise ValueError(f"{architecture} attends within a sliding window of {window} tokens. Speculative "
                         f"generation keeps rejected drafts as masked cache columns, so it serves such a target only "
                         f"while the cache fits in the window: prompt width {prompt_width} + max_new_tokens "
                         f"{new_tokens} x (k + 1 = {num_draft_tokens + 1}) = {columns} columns > {window - 1}. "
                         "Generate fewer tokens, lower k, or use plain `generate`.")
