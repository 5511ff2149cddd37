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
    GenerationConfig,
    Lfm2Config,
    Lfm2ForCausalLM,
    LogitsProcessorList,
    MistralConfig,
    MistralForCausalLM,
    StoppingCriteria,
    StoppingCriteriaList,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from hf_specformer import generate
from hf_specformer.generation.caching import PreallocatedCache


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
    kwargs = {"input_ids": input_ids, "attention_mask": mask, "max_new_tokens": 5, "step_costs": TEST_STEP_COSTS,
              **make_kwargs(input_ids, mask)}
    counter = CountingForwards(target)
    with pytest.raises(error, match=message):
        generate(target, assistant_model=drafter, **kwargs)
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
    """transformers' own loop, writing into a `PreallocatedCache` (no concatenation per step); same output."""
    target = make_target(kind)
    input_ids, mask = make_batch(5, seed=3)
    caches = []
    hook = target.register_forward_pre_hook(
        lambda module, args, kwargs: caches.append(type(kwargs.get("cache", kwargs.get("past_key_values")))),
        with_kwargs=True)
    try:
        output = assert_same_as_generate(target, make_drafter(target), input_ids, mask, num_draft_tokens=0,
                                         max_new_tokens=12)
    finally:
        hook.remove()
    stats = output.speculation_stats
    assert stats.plain_decoding and stats.drafted == 0 and stats.num_draft_tokens == 0
    assert set(caches[len(caches) // 2:]) == {PreallocatedCache}  # the speculative call's (the reference's first)


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


def test_patches_are_restored_after_an_exception():
    """An exception inside the loop leaves the target's linear layers and attention implementation as they were."""
    target = make_target("llama").float()
    drafter = make_drafter(target).float()
    target.config._attn_implementation = "sdpa"
    input_ids, mask = make_batch(3, seed=5)
    with pytest.raises(RuntimeError, match="user criterion failed"):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=20,
                 stopping_criteria=StoppingCriteriaList([RaiseAfter(2)]), schedule="fixed")
    patched = [name for name, module in [*target.named_modules(), *drafter.named_modules()]
               if "forward" in module.__dict__]
    assert patched == [] and target.config._attn_implementation == "sdpa"


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


class PatchWitness(StoppingCriteria):
    """Records the target's attention implementation, whether its layers carry a switched forward and whether that
    switch computes few-row products, inside its forwards (a pre-hook on its first decoder layer) and, at every
    stopping-criteria call, between them."""

    def __init__(self, target):
        self.target, self.inside, self.between = target, set(), set()
        target.model.layers[0].register_forward_pre_hook(lambda *args: self.inside.add(self._state()))

    def _state(self) -> tuple[str, bool, bool]:
        forward = self.target.model.layers[0].mlp.up_proj.__dict__.get("forward")
        # a `LinearSwitch._forward` partial (switch, layer, inner forward, max rows): few-row products where on and
        # allowed for this layer (max rows > 0)
        few_rows = forward is not None and forward.func.__self__.few_rows_on and forward.args[2] > 0
        return self.target.config._attn_implementation, forward is not None, few_rows

    def __call__(self, input_ids, scores, **kwargs):
        self.between.add(self._state())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def witnessed_call(seed: int, **generate_kwargs) -> PatchWitness:
    """A speculative call on a tiny sdpa Llama, watched by a `PatchWitness`; asserts it equals plain `generate` and
    leaves the model as it was."""
    target = make_target("llama")
    target.config._attn_implementation = "sdpa"
    input_ids, mask = make_batch(3, seed=seed)
    witness = PatchWitness(target)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    witness.inside.clear()
    output = generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                      max_new_tokens=10, stopping_criteria=StoppingCriteriaList([witness]), **generate_kwargs)
    assert torch.equal(output, reference)
    assert witness._state() == ("sdpa", False, False)
    return witness


@CPU_ONLY
@pytest.mark.parametrize("cpu_speedups", [True, False])
def test_cpu_speedups_switch(cpu_speedups):
    """The loop's layers are switched for the length of the call (grouped-query attention on, or off with
    `cpu_speedups=False`; the linear layers switched for packing either way, few-row products around each forward),
    and the model is itself again after it. Same output."""
    witness = witnessed_call(5, schedule="fixed", cpu_speedups=cpu_speedups)
    attention = "hf_specformer_gqa_sdpa" if cpu_speedups else "sdpa"
    assert witness.inside == {(attention, True, cpu_speedups)} and witness.between == {(attention, True, False)}


@CPU_ONLY
@pytest.mark.parametrize("cpu_speedups", [True, False])
def test_plain_decoding_runs_with_the_cpu_speedups(cpu_speedups):
    """A call that decodes plainly (k = 0: transformers' own loop) runs every forward with the CPU speed-ups, as the
    engine's width-0 steps do (or with none under `cpu_speedups=False`); the model is itself again after it. Same
    output as plain `generate`."""
    witness = witnessed_call(6, num_draft_tokens=0, cpu_speedups=cpu_speedups)
    state = ("hf_specformer_gqa_sdpa", True, True) if cpu_speedups else ("sdpa", True, False)
    assert witness.inside == {state} and witness.between == {state}


# ----- transformers' argument names ------------------------------------------------------------------------------
def untimed(stats) -> dict:
    """The statistics without the measured seconds (which differ between any two runs)."""
    return {key: value for key, value in stats.to_dict().items() if key != "seconds_per_step_by_width"}


@pytest.mark.parametrize("theirs, ours", [
    ({"num_assistant_tokens": 2}, {"num_draft_tokens": 2}),
    ({"num_assistant_tokens": 0}, {"num_draft_tokens": 0}),
    ({"prompt_lookup_num_tokens": 3}, {"num_draft_tokens": 3}),
    ({"prompt_lookup_num_tokens": 0}, {"lookup_ngram_size": 0}),
    ({"max_matching_ngram_size": 2}, {"lookup_ngram_size": 2}),
    ({"assistant_confidence_threshold": 0.4, "num_assistant_tokens_schedule": "constant"},
     {"confidence_threshold": 0.4, "schedule": "fixed"}),
])
@pytest.mark.parametrize("where", ["arguments", "generation_config"])
def test_transformers_names_do_what_ours_do(theirs, ours, where):
    target = make_target("qwen3")
    input_ids, mask = make_batch(4, seed=12)
    base = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=PAD,
                step_costs=TEST_STEP_COSTS, cost_feedback=False, return_dict_in_generate=True)
    drafter = make_drafter(target)
    if where == "arguments":
        output = generate(target, assistant_model=drafter, **base, **theirs)
    else:
        config = GenerationConfig(**{**target.generation_config.to_dict(), **theirs})
        output = generate(target, assistant_model=drafter, generation_config=config, **base)
    expected = generate(target, assistant_model=make_drafter(target), **base, **ours)
    assert torch.equal(output.sequences, expected.sequences)
    assert untimed(output.speculation_stats) == untimed(expected.speculation_stats)
    assert torch.equal(output.sequences, target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=14,
                                                         do_sample=False, pad_token_id=PAD))


def test_disagreeing_names_raise():
    target = make_target("llama")
    input_ids, mask = make_batch(2)
    with pytest.raises(ValueError, match="num_draft_tokens=3 disagrees"):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                 num_draft_tokens=3, num_assistant_tokens=2, max_new_tokens=4)
