"""Bad inputs get a clear error before any work; what speculation cannot serve exactly is rejected; what it can
(k = 0, a drafter in another dtype, sliding windows that never bite) equals plain `generate`."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_ONLY, TINY_COMMON, TINY_VOCAB, make_drafter, make_target
from helpers import PAD, TEST_STEP_COSTS, assert_same_as_generate, make_batch, noisy_oracle
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Lfm2Config,
    Lfm2ForCausalLM,
    LogitsProcessorList,
    MistralConfig,
    MistralForCausalLM,
    StoppingCriteria,
    StoppingCriteriaList,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from hf_specformer import SpeculationConfig, generate

FIELDS = {field for field in SpeculationConfig.__dataclass_fields__}


def _batch():
    input_ids, mask = make_batch(2, seed=1, min_len=3, max_len=6)
    return input_ids, mask


def _oov(input_ids, mask):
    ids = input_ids.clone()
    ids[0, -1] = TINY_VOCAB + 3
    return {"input_ids": ids}


def _negative(input_ids, mask):
    ids = input_ids.clone()
    ids[1, -1] = -1
    return {"input_ids": ids}


def _right_padded(input_ids, mask):
    return {"input_ids": input_ids.flip(1), "attention_mask": mask.flip(1)}


def _gap(input_ids, mask):
    gapped = torch.ones_like(mask)
    gapped[0, 2] = 0
    return {"attention_mask": gapped}


def _all_padding(input_ids, mask):
    return {"attention_mask": torch.cat([torch.zeros_like(mask[:1]), mask[1:]])}


# name: (kwargs from the batch, exception, message)
BAD_INPUTS = {
    "mask of another shape": (lambda i, m: {"attention_mask": m[:, :4]}, ValueError, "attention_mask has shape"),
    "empty prompt": (lambda i, m: {"input_ids": i[:, :0], "attention_mask": m[:, :0]}, ValueError, "empty"),
    "token id beyond the vocabulary": (_oov, ValueError, f"token id {TINY_VOCAB + 3}"),
    "negative token id": (_negative, ValueError, "token id -1"),
    "float token ids": (lambda i, m: {"input_ids": i.double()}, TypeError, "integer token ids"),
    "list of ids": (lambda i, m: {"input_ids": i.tolist()}, TypeError, "torch.Tensor"),
    "one-dimensional ids": (lambda i, m: {"input_ids": i[0], "attention_mask": m[0]}, ValueError, r"input_ids\[None\]"),
    "right padding": (_right_padded, ValueError, "left padding"),
    "mask with a gap": (_gap, ValueError, "gaps"),
    "mask values other than 0/1": (lambda i, m: {"attention_mask": m * 2}, ValueError, "only 0"),
    "row of padding only": (_all_padding, ValueError, r"Rows \[0\].*all padding"),
    "num_draft_tokens < 0": (lambda i, m: {"num_draft_tokens": -1}, ValueError, "at least 0"),
    "num_draft_tokens > draft_length": (lambda i, m: {"num_draft_tokens": 9}, ValueError, "draft_length=4"),
    "num_draft_tokens not an int": (lambda i, m: {"num_draft_tokens": 2.0}, TypeError, "must be an int"),
    "lookup_ngram_size < 0": (lambda i, m: {"lookup_ngram_size": -1}, ValueError, "0 \\(off\\)"),
    "lookup_ngram_size = 1": (lambda i, m: {"lookup_ngram_size": 1}, ValueError, "at least 2"),
    "compaction_hole_fraction < 0": (lambda i, m: {"compaction_hole_fraction": -0.5}, ValueError, "at least 0"),
    "confidence_threshold > 1": (lambda i, m: {"confidence_threshold": 1.5}, ValueError, "between 0 and 1"),
    "synced_gpus": (lambda i, m: {"synced_gpus": True}, ValueError, "synced_gpus"),
    "use_cache=False": (lambda i, m: {"use_cache": False}, ValueError, "use_cache"),
    "inputs_embeds": (lambda i, m: {"inputs_embeds": torch.zeros(2, 6, 48, dtype=torch.float64)}, ValueError,
                      "inputs_embeds"),
    "classifier-free guidance": (lambda i, m: {"guidance_scale": 1.5}, ValueError, "guidance"),
    "max_new_tokens = 0": (lambda i, m: {"max_new_tokens": 0}, ValueError, "max_new_tokens"),
}


class CountingForwards:
    """Counts the target's forwards, to show that an error comes before any work."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self.hook)

    def hook(self, module, args):
        self.calls += 1


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_raises_a_clear_error_before_any_work(name):
    target = make_target("llama")
    drafter = make_drafter(target)
    input_ids, mask = _batch()
    make_kwargs, error, message = BAD_INPUTS[name]
    kwargs = {"input_ids": input_ids, "attention_mask": mask, "max_new_tokens": 5, **make_kwargs(input_ids, mask)}
    speculation = {"step_costs": TEST_STEP_COSTS, **{name: kwargs.pop(name) for name in list(kwargs) if name in FIELDS}}
    counter = CountingForwards(target)
    with pytest.raises(error, match=message):
        generate(target, assistant_model=drafter, speculation_config=speculation, **kwargs)
    assert counter.calls == 0


def test_stateful_guidance_processor_is_rejected():
    target = make_target("llama")
    input_ids, mask = _batch()
    processors = LogitsProcessorList([UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, target)])
    with pytest.raises(ValueError, match="UnbatchedClassifierFreeGuidanceLogitsProcessor"):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                 logits_processor=processors, max_new_tokens=4)


class _NeedsLengths:
    """A processor whose `__call__` wants an argument that generation never passes."""

    def __call__(self, input_ids, scores, lengths):
        return scores


def test_processor_needing_more_arguments_is_rejected_like_plain_generate():
    target = make_target("llama")
    input_ids, mask = _batch()
    processors = LogitsProcessorList([_NeedsLengths()])
    with pytest.raises(ValueError, match="_NeedsLengths"):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                 logits_processor=processors, max_new_tokens=4)
    with pytest.raises(ValueError, match="required parameters"):
        target.generate(input_ids=input_ids, attention_mask=mask, logits_processor=processors, max_new_tokens=4)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_zero_draft_tokens_is_plain_decoding(kind):
    """The engine's plain steps on its preallocated cache, one input per row and step; same output."""
    target = make_target(kind)
    input_ids, mask = make_batch(5, seed=3)
    widths = []
    hook = target.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        output = assert_same_as_generate(target, make_drafter(target), input_ids, mask, num_draft_tokens=0,
                                         max_new_tokens=12)
    finally:
        hook.remove()
    stats = output.speculation_stats
    assert stats.width_counts == [stats.steps] == [11] and stats.drafted == 0 and stats.num_draft_tokens == 0
    assert widths[-11:] == [1] * 11  # after the prefill: one input per row and step


def test_drafter_in_another_dtype_is_lossless():
    """A float32 drafter on a float64 target: drafts change, outputs do not."""
    target = make_target("qwen3")
    drafter = make_drafter(target).float()
    input_ids, mask = make_batch(6, seed=8)
    output = assert_same_as_generate(target, drafter, input_ids, mask, max_new_tokens=20, schedule="fixed")
    assert output.speculation_stats.drafted > 0


class RaiseAfter(StoppingCriteria):
    """A user stopping criterion that fails after `calls` calls."""

    def __init__(self, calls: int):
        self.remaining = calls

    def __call__(self, input_ids, scores, **kwargs):
        self.remaining -= 1
        if self.remaining < 0:
            raise RuntimeError("user criterion failed")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def test_the_models_are_left_as_they_were_also_after_an_exception():
    """The call records hidden states through hooks on the target's layers, and writes nothing onto the models: after
    it (and after an exception inside its loop) no hook, no forward and no attribute of theirs has changed."""
    target = make_target("llama").float()
    drafter = make_drafter(target).float()
    target.config._attn_implementation = "sdpa"
    input_ids, mask = make_batch(3, seed=5)
    before = [dict(vars(module)) for module in (target, drafter, target.config, drafter.config)]
    generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=6)
    with pytest.raises(RuntimeError, match="user criterion failed"):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=20,
                 stopping_criteria=StoppingCriteriaList([RaiseAfter(2)]), speculation_config={"schedule": "fixed"})
    modules = [*target.modules(), *drafter.modules()]
    assert not [module for module in modules if "forward" in module.__dict__ or module._forward_hooks
                or module._forward_pre_hooks]
    after = [dict(vars(module)) for module in (target, drafter, target.config, drafter.config)]
    assert [set(a) ^ set(b) for a, b in zip(before, after)] == [set()] * 4
    assert target.config._attn_implementation == "sdpa"


# ----- sliding-window and hybrid targets ------------------------------------------------------------------------
def tiny_mistral(window: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(sliding_window=window, **TINY_COMMON)).double().eval()


def tiny_gemma2(window: int) -> torch.nn.Module:
    """Alternating sliding and full layers."""
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=TINY_VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=12, sliding_window=window,
                          pad_token_id=PAD)
    return Gemma2ForCausalLM(config).double().eval()


def _oracle_for(target, input_ids, mask, k, max_new_tokens, padded=True):
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                max_new_tokens=max_new_tokens)
    return noisy_oracle(reference[:, input_ids.shape[1]:], k, TINY_VOCAB, corrupt=0.3)


@CPU_ONLY
@pytest.mark.parametrize("factory", [tiny_mistral, tiny_gemma2], ids=["mistral", "gemma2"])
def test_sliding_window_that_never_bites_equals_generate(factory):
    """Window 64 holds prompt 10 + 12 tokens x (k + 1 = 4) columns: served, token for token."""
    target = factory(64)
    input_ids, mask = make_batch(4, seed=6, max_len=10, padded=factory is tiny_mistral)
    oracle = _oracle_for(target, input_ids, mask, 3, 12)
    output = assert_same_as_generate(target, oracle, input_ids, mask, max_new_tokens=12, schedule="fixed",
                                     lookup_ngram_size=0)
    assert output.speculation_stats.accepted > 0


@CPU_ONLY
@pytest.mark.parametrize("factory, name", [(tiny_mistral, "MistralForCausalLM"), (tiny_gemma2, "Gemma2ForCausalLM")])
def test_sliding_window_the_cache_could_outgrow_is_rejected(factory, name):
    target = factory(16)
    input_ids, mask = make_batch(2, seed=6, max_len=10, padded=False)
    counter = CountingForwards(target)
    with pytest.raises(ValueError, match=f"{name} attends within a sliding window of 16"):
        generate(target, input_ids=input_ids, attention_mask=mask, max_new_tokens=12,
                 assistant_model=_oracle_for(target, input_ids, mask, 3, 1))
    assert counter.calls == 1  # only the oracle's reference above


def test_hybrid_target_with_convolution_layers_is_rejected():
    torch.manual_seed(0)
    config = Lfm2Config(vocab_size=TINY_VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
                        pad_token_id=PAD)
    target = Lfm2ForCausalLM(config).double().eval()
    input_ids, mask = make_batch(2, seed=6, padded=False)
    oracle = noisy_oracle(torch.zeros(2, 8, dtype=torch.long), 2, TINY_VOCAB, corrupt=0.0)
    with pytest.raises(ValueError, match=r"Lfm2ForCausalLM has \['conv'\] layers"):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=oracle, max_new_tokens=4)


@CPU_ONLY
def test_sliding_cache_length_follows_compaction():
    """Compaction gathers a sliding layer's columns and its count of columns together, so its masks keep their
    size; with compaction every step the outputs stay those of `generate`."""
    target = tiny_mistral(200)
    input_ids, mask = make_batch(6, seed=9, max_len=12)
    oracle = _oracle_for(target, input_ids, mask, 3, 30)
    output = assert_same_as_generate(target, oracle, input_ids, mask, max_new_tokens=30, schedule="fixed",
                                     lookup_ngram_size=0, compaction_hole_fraction=0.0)
    assert output.speculation_stats.accepted > 0
