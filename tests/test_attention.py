"""`GQA_SDPA`: a target loaded with it computes its own logits under a mask with several queries per row, without
copying key/value heads, packed queries attend as repeated heads, and speculative `generate` on it equals plain
`generate` (on `TEST_DEVICE`)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TEST_DEVICE, make_drafter, make_target
from generation.helpers import PAD, make_batch

from hf_specformer import GQA_SDPA, generate
from hf_specformer import attention
from hf_specformer.attention import (
    MATMUL_MIN_ROWS,
    PACKED_QUERY_LIMIT,
    grouped_matmul_attention,
    packed_query_attention,
)


def _loaded_with(target, attn_implementation: str):
    """A copy of `target` that uses `attn_implementation` (as `from_pretrained(..., attn_implementation=)` loads)."""
    loaded = type(target)(copy.deepcopy(target.config)).to(device=target.device, dtype=target.dtype).eval()
    loaded.load_state_dict(target.state_dict())
    loaded.set_attn_implementation(attn_implementation)
    assert target.config._attn_implementation != attn_implementation, "the target's own config must stay as it was"
    return loaded.requires_grad_(False)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("num_queries", [2, PACKED_QUERY_LIMIT, PACKED_QUERY_LIMIT + 1])
def test_masked_multi_query_attention_is_the_targets_own(kind, num_queries, monkeypatch):
    """Padded rows, a cache, several new queries per row: the `sdpa` target's logits, with SDPA on grouped heads
    (`enable_gqa` on the CPU; elsewhere queries packed per key/value head up to `PACKED_QUERY_LIMIT`, beyond it
    `sdpa`'s own function)."""
    target = make_target(kind)
    target.set_attn_implementation("sdpa")
    grouped = _loaded_with(target, GQA_SDPA)
    input_ids, mask = make_batch(4, seed=1, min_len=num_queries + 2, max_len=num_queries + 8)
    with torch.no_grad():
        prefix = target(input_ids[:, :-num_queries], attention_mask=mask[:, :-num_queries], use_cache=True).cache
        reference = target(input_ids[:, -num_queries:], attention_mask=mask, cache=prefix).logits
        prefix.crop(-num_queries)
        heads_seen = []
        sdpa = torch.nn.functional.scaled_dot_product_attention
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            lambda q, k, v, **kw: heads_seen.append((q.shape[1:3], k.shape[1], kw.get("enable_gqa")))
                            or sdpa(q, k, v, **kw))
        logits = grouped(input_ids[:, -num_queries:], attention_mask=mask, cache=prefix).logits
    config = target.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if TEST_DEVICE.type == "cpu":
        expected = ((heads, num_queries), kv_heads, True)
    elif num_queries <= PACKED_QUERY_LIMIT:
        expected = ((kv_heads, heads // kv_heads * num_queries), kv_heads, None)
    else:
        expected = ((heads, num_queries), heads, None)
    assert heads_seen == [expected] * config.num_hidden_layers
    torch.testing.assert_close(logits, reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("packed", [packed_query_attention, grouped_matmul_attention])
@pytest.mark.parametrize("num_queries", [1, 4, PACKED_QUERY_LIMIT])
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (6, 6), (1, 1)])
def test_packed_queries_attend_as_repeated_key_value_heads(packed, num_queries, heads, kv_heads):
    """The packings (through `sdpa` off the CPU, through two products on it from `MATMUL_MIN_ROWS` rows), on
    `TEST_DEVICE`: each query head attends to its own key/value head under the mask's rows, as `sdpa` on repeated
    heads; the caller's mask is left as it was."""
    generator = torch.Generator().manual_seed(num_queries)
    batch, columns, dim = 3, 11, 8
    query, key, value = (torch.randn(batch, h, n, dim, generator=generator, dtype=torch.float64).to(TEST_DEVICE)
                         for h, n in ((heads, num_queries), (kv_heads, columns), (kv_heads, columns)))
    hidden = torch.rand(batch, 1, num_queries, columns, generator=generator) < 0.3
    hidden[..., 0] = False  # every query sees a column
    mask = torch.zeros(hidden.shape, dtype=torch.float64).masked_fill(hidden, torch.finfo(torch.float64).min)
    mask = mask.to(TEST_DEVICE)
    repeated = [t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value)]
    expected = torch.nn.functional.scaled_dot_product_attention(query, *repeated, attn_mask=mask, scale=0.3)
    given = mask.clone()
    torch.testing.assert_close(packed(query, key, value, mask, scaling=0.3), expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(mask, given)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("batch_size", [1, 5, MATMUL_MIN_ROWS + 1])
def test_speculative_generate_on_a_target_loaded_with_it_equals_plain_generate(kind, batch_size, monkeypatch):
    """From `MATMUL_MIN_ROWS` rows on the CPU the verification forwards attend through `grouped_matmul_attention`."""
    products = []
    monkeypatch.setattr(attention, "grouped_matmul_attention",
                        lambda *args: products.append(args[0].shape) or grouped_matmul_attention(*args))
    target = make_target(kind)
    target.set_attn_implementation("sdpa")
    grouped = _loaded_with(target, GQA_SDPA)
    input_ids, mask = make_batch(batch_size, seed=3, padded=batch_size > 1)
    kwargs = dict(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    reference = target.generate(**kwargs)
    assert torch.equal(grouped.generate(**kwargs), reference)
    output = generate(grouped, assistant_model=make_drafter(grouped), **kwargs, return_dict_in_generate=True,
                      speculation_config={"schedule": "fixed"})
    assert torch.equal(output.sequences, reference)
    assert output.speculation_stats.drafted > 0
    assert bool(products) == (TEST_DEVICE.type == "cpu" and batch_size >= MATMUL_MIN_ROWS)


def test_a_speculative_call_on_an_sdpa_grouped_query_target_says_how_to_avoid_the_copies(monkeypatch):
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    from hf_specformer.generation import engine

    monkeypatch.setattr(logging.logging.Logger, "warning_once", logging.logging.Logger.warning)  # not once per process
    target = make_target("qwen3")
    target.set_attn_implementation("sdpa")
    input_ids, mask = make_batch(2, seed=4)
    kwargs = dict(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=4, pad_token_id=PAD)
    for model, says in ((target, True), (_loaded_with(target, GQA_SDPA), False)):
        with CaptureLogger(engine.logger) as captured:
            generate(model, assistant_model=make_drafter(model), **kwargs)
        assert ("attn_implementation='hf_specformer_gqa_sdpa'" in captured.out) == says
