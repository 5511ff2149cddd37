"""`generate_batch`: many requests in one speculative call with continuous batching, one output per request.

transformers' `model.generate_batch(inputs, generation_config)` keeps its slots busy (continuous batching, paged
cache) but takes no assistant model. This takes the same inputs (token-id lists of any lengths) and runs them through
speculative `generate` with `max_batch_size` slots: at most that many rows decode at once, and waiting requests are
admitted as others finish (`admission.py`). Greedy outputs equal plain `generate`'s for each prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from .generate import generate
from .validation import resolved_config, resolved_pad_token_id

FINISH_REASONS = ("eos", "length", "stop")
"""Why a request ended: an end-of-sequence token, `max_new_tokens`, or a stop string / stopping criterion."""


@dataclass
class RequestOutput:
    """One request's result.

    Attributes:
        prompt_ids: the request's prompt.
        generated_tokens: the tokens generated after it (its end-of-sequence token included, if it ended on one).
        finish_reason: one of `FINISH_REASONS`.
        tokens_per_step: tokens committed per verification step of this request (kappa; 1.0 without speculation).
    """

    prompt_ids: list[int]
    generated_tokens: list[int]
    finish_reason: str
    tokens_per_step: float


def generate_batch(
    model,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None = None,
    assistant_model=None,
    max_batch_size: int = 16,
    **kwargs,
) -> list[RequestOutput]:
    """Speculative generation for `inputs` (token-id lists), `max_batch_size` rows at a time with continuous
    batching; `assistant_model` and `kwargs` as `hf_specformer.generate` takes them. Returns one `RequestOutput`
    per request, in order."""
    if not inputs or any(not isinstance(ids, (list, tuple)) or not ids for ids in inputs):
        raise ValueError("inputs must be a non-empty list of non-empty token-id lists.")
    config, _ = resolved_config(model, generation_config, dict(kwargs))
    pad = resolved_pad_token_id(config)
    pad = 0 if pad is None else pad
    width = max(map(len, inputs))
    input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in inputs], device=model.device)
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in inputs], device=model.device)
    output = generate(model, input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config,
                      assistant_model=assistant_model, max_batch_size=max_batch_size, return_dict_in_generate=True,
                      **{**kwargs, "pad_token_id": pad})
    stats = output.speculation_stats
    limit = output.sequences.shape[1] - width if stats.plain_decoding else None
    new_tokens = stats.new_tokens or [limit] * len(inputs)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    maximum = config.max_new_tokens if config.max_new_tokens is not None else 20
    kappas = stats.tokens_per_row_step if not stats.plain_decoding else [1.0] * len(inputs)
    results = []
    for prompt, row, count, kappa in zip(inputs, output.sequences[:, width:].tolist(), new_tokens, kappas):
        generated = row[:count]
        if stats.plain_decoding:
            generated = _cut_padding(generated, eos, pad)
        reason = "eos" if generated and generated[-1] in eos else "length" if len(generated) >= maximum else "stop"
        results.append(RequestOutput(list(prompt), generated, reason, kappa))
    return results


def _cut_padding(generated: list[int], eos: list[int], pad: int) -> list[int]:
    """A row of transformers' own loop (the call ran plain decoding), which pads after the row's end: cut after its
    first end-of-sequence token, else before the trailing padding (a request that ended on a stop string and then
    generated the pad token itself would lose it: only that loop knows where its rows ended)."""
    ends = [i for i, token in enumerate(generated) if token in eos]
    if ends:
        return generated[: ends[0] + 1]
    while generated and generated[-1] == pad:
        generated = generated[:-1]
    return generated
