"""Greedy speculative generation equals plain `generate`, token for token, across the engine's ragged cases:
batch sizes, padding, EOS, lengths, processors, stopping criteria, schedules, continuous batching."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_ONLY, TINY_VOCAB, make_companion, make_drafter, make_target
from helpers import (
    PAD,
    TEST_STEP_COSTS,
    SoftOracle,
    assert_same_as_generate,
    make_batch,
    noisy_oracle,
    optimistic_table,
)
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_specformer import OracleProposer, SpecFormerProposer, StepCosts, generate
from hf_specformer.generation import batch as batch_module
from hf_specformer.generation.batch import NewRow, RowFeed
from hf_specformer.generation.engine import record_hidden_states, slot_bytes
from hf_specformer.training.target_states import next_token_ids

# name: (target kind, drafter, batch size, k, padded, eos mode, max_new_tokens)
CASES = {
    "llama-b1-k1-untrained": ("llama", "untrained", 1, 1, False, None, 12),
    "llama-b3-k4-oracle-pad-eos": ("llama", "oracle", 3, 4, True, "mid", 24),
    "llama-b8-k2-noisy-pad-eos": ("llama", "noisy", 8, 2, True, "mid", 30),
    "llama-b32-k4-untrained-pad": ("llama", "untrained", 32, 4, True, None, 16),
    "llama-b16-k3-noisy-pad-eos-multi": ("llama", "noisy", 16, 3, True, "several", 40),
    "qwen3-b1-k4-oracle": ("qwen3", "oracle", 1, 4, False, None, 20),
    "qwen3-b5-k4-untrained-pad-eos": ("qwen3", "untrained", 5, 4, True, "mid", 25),
    "qwen3-b32-k2-noisy-pad-eos": ("qwen3", "noisy", 32, 2, True, "mid", 20),
    "qwen3-b12-k1-oracle-pad-len1": ("qwen3", "oracle", 12, 1, True, None, 1),
    "qwen3-b7-k3-noisy-pad-eos": ("qwen3", "noisy", 7, 3, True, "several", 33),
    "llama-b4-k3-vocab-pad-eos": ("llama", "vocab", 4, 3, True, "mid", 20),
    "qwen3-b6-k4-vocab-pad": ("qwen3", "vocab", 6, 4, True, None, 18),
}


def _eos_ids(reference_new: torch.LongTensor, mode: str | None):
    """EOS ids that rows reach at different steps: tokens the reference greedy output produces mid-way."""
    if mode is None:
        return None
    ids = [int(reference_new[0, reference_new.shape[1] // 3])]
    if mode == "several":
        ids.append(int(reference_new[-1, reference_new.shape[1] // 2]))
    return ids


@pytest.mark.parametrize("schedule", ["fixed", "goodput"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_equals_generate(case, schedule):
    kind, drafter_kind, batch_size, k, padded, eos_mode, max_new = CASES[case]
    target = make_target(kind)
    input_ids, mask = make_batch(batch_size, seed=batch_size + k, padded=padded)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new)
    eos = _eos_ids(reference[:, input_ids.shape[1]:], eos_mode)
    kwargs = dict(max_new_tokens=max_new, pad_token_id=PAD, **({} if eos is None else {"eos_token_id": eos}))
    new_tokens = reference[:, input_ids.shape[1]:]
    assistant = {
        "untrained": lambda: make_drafter(target, draft_length=4),
        "vocab": lambda: make_drafter(target, draft_length=4).set_draft_vocab(torch.randperm(TINY_VOCAB)[:40]),
        "oracle": lambda: OracleProposer(new_tokens, k, TINY_VOCAB, PAD),
        "noisy": lambda: noisy_oracle(new_tokens, k, TINY_VOCAB, corrupt=0.3),
    }[drafter_kind]()
    output = assert_same_as_generate(
        target, assistant, input_ids, mask, num_draft_tokens=k if drafter_kind in ("untrained", "vocab") else None,
        lookup_ngram_size=0 if drafter_kind == "oracle" else None, schedule=schedule, **kwargs)
    stats = output.speculation_stats
    assert len(stats.accepted_at) == k and sum(stats.width_counts) == stats.steps
    if drafter_kind == "oracle" and eos is None and max_new > 1 and schedule == "fixed":
        assert stats.acceptance_rate == 1.0 and stats.tokens_per_step == k + 1


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_prefix_reading_processors_and_min_new_tokens(kind):
    """Repetition penalty and min_new_tokens read each row's exact prefix, drafts included."""
    target = make_target(kind)
    input_ids, mask = make_batch(6, seed=11)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    eos = int(reference[0, input_ids.shape[1] + 2])  # a token rows would emit early: min_new_tokens must hold it
    oracle = noisy_oracle(reference[:, input_ids.shape[1]:], 3, TINY_VOCAB, corrupt=0.2)
    output = assert_same_as_generate(target, oracle, input_ids, mask, max_new_tokens=20, repetition_penalty=1.3,
                                     min_new_tokens=6, eos_token_id=eos, pad_token_id=PAD)
    assert (output.sequences[:, input_ids.shape[1]: input_ids.shape[1] + 6] != eos).all()


def test_tensors_that_outlive_a_call_serve_autograd_later():
    """The loop runs in inference mode; what leaves it (the output, the drafter's draft-vocabulary head it built)
    must still work in training afterwards."""
    target = make_target("llama")
    drafter = make_drafter(target, draft_length=3).set_draft_vocab(torch.randperm(TINY_VOCAB)[:40])
    input_ids, mask = make_batch(2, seed=5)
    output = generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=6,
                      do_sample=False, pad_token_id=PAD, return_dict_in_generate=True)
    assert not output.sequences.is_inference()
    output.sequences[:, -1] = PAD  # an ordinary tensor takes in-place writes
    states = torch.randn(2, target.config.hidden_size, dtype=target.dtype, requires_grad=True)
    drafter.draft_head()(states).sum().backward()  # the head built during the call is saved for backward
    assert states.grad is not None


class StopAfterToken(StoppingCriteria):
    """Stops a row once `token` has been generated (a user criterion the engine cannot vectorise)."""

    def __init__(self, token: int, prompt_width: int):
        self.token, self.prompt_width = token, prompt_width

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, self.prompt_width:] == self.token).any(dim=1)


def test_user_stopping_criteria_stop_at_the_same_token():
    target = make_target("llama")
    input_ids, mask = make_batch(5, seed=3)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    criteria = StoppingCriteriaList([StopAfterToken(int(reference[2, input_ids.shape[1] + 7]), input_ids.shape[1])])
    oracle = OracleProposer(reference[:, input_ids.shape[1]:], 4, TINY_VOCAB, PAD)
    assert_same_as_generate(target, oracle, input_ids, mask, max_new_tokens=24, stopping_criteria=criteria,
                            pad_token_id=PAD)


class CollectingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten())

    def end(self):
        self.ended = True


def test_streamer_batch_size_one():
    target = make_target("llama")
    input_ids, mask = make_batch(1, seed=5, padded=False)
    streamer = CollectingStreamer()
    output = generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                      max_new_tokens=15, do_sample=False, streamer=streamer)
    assert streamer.ended and torch.equal(torch.cat(streamer.chunks), output[0].cpu())


@pytest.mark.parametrize("hole_fraction", [0.0, 0.3, 2.0], ids=["compact-every-step", "compact-at-30%", "never"])
def test_compaction_policy_does_not_change_outputs(hole_fraction):
    target = make_target("qwen3")
    input_ids, mask = make_batch(9, seed=21)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    oracle = noisy_oracle(reference[:, input_ids.shape[1]:], 4, TINY_VOCAB, corrupt=0.25, seed=3)
    assert_same_as_generate(target, oracle, input_ids, mask, max_new_tokens=30, pad_token_id=PAD,
                            compaction_hole_fraction=hole_fraction)


@pytest.mark.parametrize("kind, batch_size, k, eos_mode, threshold", [
    ("llama", 1, 4, None, 0.3), ("qwen3", 6, 4, "mid", 0.3), ("llama", 16, 8, "several", 0.6),
    ("qwen3", 32, 3, "mid", 0.9)])
def test_confidence_threshold_verifies_fewer_drafts_with_the_same_output(kind, batch_size, k, eos_mode, threshold):
    """Rows verify different numbers of drafts per step (their cumulative draft probability against the threshold),
    and the step is as wide as its longest row; the output is still plain `generate`'s."""
    target = make_target(kind)
    input_ids, mask = make_batch(batch_size, seed=40 + batch_size)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    eos = _eos_ids(reference[:, input_ids.shape[1]:], eos_mode)
    oracle = SoftOracle(reference[:, input_ids.shape[1]:], k, TINY_VOCAB, corrupt=0.2, seed=batch_size)
    output = assert_same_as_generate(
        target, oracle, input_ids, mask, lookup_ngram_size=0, schedule="fixed", confidence_threshold=threshold,
        max_new_tokens=30, pad_token_id=PAD, **({} if eos is None else {"eos_token_id": eos}))
    stats = output.speculation_stats
    assert 1 < stats.drafts_per_step < k and stats.accepted > 0, stats.drafts_per_step


def tiny_gemma2() -> torch.nn.Module:
    """A tiny Gemma2: it scales its embeddings before the first layer and soft-caps its logits."""
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=TINY_VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=12, final_logit_softcapping=5.0,
                          pad_token_id=PAD)
    return Gemma2ForCausalLM(config).double().eval()


@CPU_ONLY
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("recorded", ["all", "ends", "middle", "none"])
def test_recorded_hidden_states_are_the_models_own(kind, recorded):
    """The states recorded by the call's hooks are `output_hidden_states`' at the indices asked for (None at the
    others), and the forward's logits are the model's own."""
    target = tiny_gemma2() if kind == "gemma2" else make_target(kind)
    num_layers = target.config.num_hidden_layers
    indices = {"all": range(num_layers + 1), "ends": {0, num_layers}, "middle": {1}, "none": ()}[recorded]
    input_ids, mask = make_batch(2, seed=4, padded=False)
    with record_hidden_states(target, frozenset(indices)) as states:
        logits = target(input_ids=input_ids, attention_mask=mask, cache=DynamicCache()
                        ).logits
    model = target(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
    torch.testing.assert_close(logits, model.logits, rtol=0, atol=1e-10)
    for index, (ours, theirs) in enumerate(zip(states, model.hidden_states, strict=True)):
        if index in indices:
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)
        else:
            assert ours is None
    assert not target.model.layers[0]._forward_pre_hooks and not target.model._forward_hooks  # removed after


def test_recorded_hidden_states_reject_indices_outside_the_target():
    target = make_target("llama")
    with pytest.raises(ValueError, match="outside 0"):
        with record_hidden_states(target, {target.config.num_hidden_layers + 1}):
            pass


class RecordingProposer(SpecFormerProposer):
    """A SpecFormer proposer that records `(row id, tokens generated so far, draft logits [k, V])` per proposal."""

    def __init__(self, drafter, num_draft_tokens):
        super().__init__(drafter, num_draft_tokens)
        self.records = []

    def propose(self, batch, step, caches, draft=True, free=True):
        proposal = super().propose(batch, step, caches, draft, free)
        if proposal.drafted:
            self.records.extend(zip(batch.row_ids.tolist(), batch.num_generated[batch.row_ids].tolist(),
                                    proposal.logits))
        return proposal


@CPU_ONLY
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_drafts_with_next_token_input_equal_the_full_sequence_forward(kind):
    """Every draft the engine proposes (padded rows, rejected drafts, cache compaction) equals the drafter's forward
    over the finished sequence at the same position, with each position's next token as training feeds it."""
    target = make_target(kind)
    drafter = make_drafter(target, next_token_input=True)
    torch.nn.init.normal_(drafter.context_block.next_token_input.weight, std=0.3)
    input_ids, mask = make_batch(6, seed=2)
    proposer = RecordingProposer(drafter, 3)
    output = assert_same_as_generate(target, proposer, input_ids, mask, schedule="fixed", max_new_tokens=20,
                                     pad_token_id=PAD)
    width, checked = input_ids.shape[1], 0
    for row, generated, logits in proposer.records:
        new = output.sequences[row, width:]
        is_eos = new == target.config.eos_token_id
        length = int(is_eos.long().argmax()) + 1 if is_eos.any() else new.numel()
        if generated >= length:  # the row's last commit: it retires without drafting again
            continue
        ids = torch.cat([input_ids[row][mask[row].bool()], new[:length]])[None]
        with torch.no_grad():
            hooked = drafter.select_hooked_states(target(ids, output_hidden_states=True).hidden_states)
        position = ids.shape[1] - length + generated - 2  # the input before the last committed token
        full = drafter(hooked, use_cache=False, draft_positions=torch.tensor([[position]]), num_draft_tokens=3,
                       next_token_ids=next_token_ids(ids)).logits[0, 0]
        torch.testing.assert_close(logits, full, rtol=1e-9, atol=1e-9)
        checked += 1
    assert checked > 6  # every row, several steps


# name: (target kind, batch size, k, padded, eos mode, max_new_tokens)
COMPANION_CASES = {
    "llama-b1-k3": ("llama", 1, 3, False, None, 20),
    "llama-b16-k4-pad-eos": ("llama", 16, 4, True, "mid", 30),
    "qwen3-b7-k2-pad-eos-multi": ("qwen3", 7, 2, True, "several", 25),
    "qwen3-b32-k3-pad": ("qwen3", 32, 3, True, None, 16),
}


@pytest.mark.parametrize("case", sorted(COMPANION_CASES))
def test_goodput_with_a_companion_equals_generate(case):
    """SV's (S, A) signals from a companion drive the goodput scheduler; a noisy oracle (30% wrong drafts) makes
    rows accept different numbers of drafts and the online table learn."""
    kind, batch_size, k, padded, eos_mode, max_new = COMPANION_CASES[case]
    target = make_target(kind)
    input_ids, mask = make_batch(batch_size, seed=batch_size * 3 + k, padded=padded)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new)
    new_tokens = reference[:, input_ids.shape[1]:]
    eos = _eos_ids(new_tokens, eos_mode)
    companion = make_companion(target)
    companion.config.acceptance_table = optimistic_table("sv")
    output = assert_same_as_generate(
        target, noisy_oracle(new_tokens, k, TINY_VOCAB, corrupt=0.3), input_ids, mask, lookup_ngram_size=0,
        companion_model=companion, max_new_tokens=max_new, pad_token_id=PAD, **({"eos_token_id": eos} if eos else {}))
    stats = output.speculation_stats
    assert sum(stats.width_counts) == stats.steps and stats.drafted > 0


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_goodput_skips_drafting_that_does_not_pay_and_stays_lossless(kind):
    """An untrained drafter's drafts are rarely right and it knows it (low confidence): the scheduler verifies
    none, stops running the drafter's slot stage (its context cache keeps growing) and probes now and then."""
    target = make_target(kind)
    input_ids, mask = make_batch(12, seed=5)
    output = assert_same_as_generate(target, make_drafter(target), input_ids, mask, num_draft_tokens=3,
                                     lookup_ngram_size=0, max_new_tokens=40, pad_token_id=PAD)
    stats = output.speculation_stats
    assert stats.width_counts[0] > stats.steps // 2, stats.width_counts
    assert 0 < stats.drafting_steps < stats.steps, (stats.drafting_steps, stats.steps)


def test_goodput_verifies_wide_steps_for_an_oracle():
    """All drafts right: the estimates climb and most steps verify all k."""
    target = make_target("llama")
    input_ids, mask = make_batch(8, seed=2)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    oracle = OracleProposer(reference[:, input_ids.shape[1]:], 4, TINY_VOCAB, PAD)
    output = assert_same_as_generate(target, oracle, input_ids, mask, lookup_ngram_size=0, max_new_tokens=40,
                                     pad_token_id=PAD)
    stats = output.speculation_stats
    assert stats.width_counts[4] >= stats.steps - 2, stats.width_counts
    assert abs(stats.predicted_acceptance_rate - stats.acceptance_rate) < 0.15


def test_finished_rows_stay_as_padding_commit_nothing_and_are_not_counted(monkeypatch):
    """Rows of a batch of 8 end at different steps (EOS); the engine drops them only when the batch falls to 4, 2, 1
    and 0 rows. Padding rows verify nothing and are no row-steps: with every oracle draft right, each row's kappa is
    exactly k + 1."""
    kept = []
    select_rows = batch_module.RaggedBatch.select_rows
    monkeypatch.setattr(batch_module.RaggedBatch, "select_rows", lambda self, keep: (kept.append(len(keep)),
                                                                                    select_rows(self, keep))[1])
    target = make_target("llama")
    input_ids, mask = make_batch(8, seed=11, padded=True)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    new_tokens = reference[:, input_ids.shape[1]:]
    eos = sorted({int(new_tokens[row, 3 * row + 1]) for row in range(8)})  # every row ends well before 40 tokens
    output = assert_same_as_generate(target, OracleProposer(new_tokens, 2, TINY_VOCAB, PAD), input_ids, mask,
                                     lookup_ngram_size=0, max_new_tokens=40, pad_token_id=PAD, eos_token_id=eos,
                                     schedule="fixed")
    assert kept and set(kept) <= {4, 2, 1, 0}, kept
    assert output.speculation_stats.tokens_per_row == [3.0] * 8


# ----- continuous batching: rows admitted into the running batch as others finish ---------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("max_batch_size", [1, 3, 5])
@pytest.mark.parametrize("schedule", ["goodput", "fixed"])
def test_rows_admitted_mid_call_give_the_output_of_generate(kind, max_batch_size, schedule):
    """9 ragged prompts through 1, 3 or 5 slots (rows join as others finish: at EOS, at different steps, or at
    max_new_tokens), with the drafter and prompt lookup, caches compacted whenever holes appear: every row equals
    plain `generate` of the whole batch, and no step held more rows than the slots."""
    target = make_target(kind)
    input_ids, mask = make_batch(9, seed=31)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    stats = assert_same_as_generate(
        target, make_drafter(target), input_ids, mask, schedule=schedule, max_new_tokens=24, pad_token_id=PAD,
        eos_token_id=int(reference[2, input_ids.shape[1] + 6]), compaction_hole_fraction=0.0,
        max_batch_size=max_batch_size).speculation_stats
    assert stats.row_steps <= max_batch_size * stats.steps and stats.drafted > 0, (stats.row_steps, stats.steps)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_admissions_keep_prefix_processors_and_suffix_drafts_lossless(kind):
    """Prefix-reading processors (repetition penalty, min_new_tokens) and suffix drafts across rows admitted at
    different times: still `generate`'s output."""
    target = make_target(kind)
    input_ids, mask = make_batch(7, seed=5)
    assert_same_as_generate(target, make_drafter(target), input_ids, mask, max_new_tokens=20, pad_token_id=PAD,
                            repetition_penalty=1.3, min_new_tokens=6, suffix_index=True, max_batch_size=2)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_continuous_batching_without_drafts_equals_generate(kind):
    """k = 0 with fewer slots than rows: plain steps in the engine, rows admitted as others finish."""
    target = make_target(kind)
    input_ids, mask = make_batch(7, seed=8)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    eos = int(reference[2, input_ids.shape[1] + 4])
    stats = assert_same_as_generate(target, make_drafter(target), input_ids, mask, num_draft_tokens=0,
                                    max_batch_size=3, max_new_tokens=12, eos_token_id=eos,
                                    pad_token_id=PAD).speculation_stats
    assert stats.drafted == 0 and stats.width_counts == [stats.steps] and stats.steps > 0


@CPU_ONLY
def test_rows_admitted_after_the_batch_emptied_start_from_fresh_columns():
    """Every running row finishes on the same step while the drafter's work is deferred (drafting never pays at
    these costs), so the batch empties with the drafter's cache behind the target's; the rows admitted next start
    from their own columns in every cache, and each answer is still `generate`'s."""
    target = make_target()
    generator = torch.Generator().manual_seed(6)
    same, *others = [torch.randint(3, 90, (length,), generator=generator) for length in (7, 3, 9)]
    prompts = [same, same, *others]  # the first two finish together; the next two, of other lengths, join together
    # (prefilled apart: 9 tokens are over twice 3)
    input_ids = torch.stack([torch.cat([torch.full((9 - len(p),), PAD), p]) for p in prompts])
    mask = (torch.arange(9)[None, :] >= torch.tensor([9 - len(p) for p in prompts])[:, None]).long()
    costly_drafts = StepCosts(plain=1.0, per_input=100.0, draft=100.0, learn=False)
    assert_same_as_generate(target, make_drafter(target), input_ids, mask, max_new_tokens=14, pad_token_id=PAD,
                            max_batch_size=2, step_costs=costly_drafts)


def test_prompts_of_far_apart_lengths_are_prefilled_apart_and_equal_generate():
    """Prompts of 2, 40, 3 and 36 tokens: two prefill forwards (widths 40 and 3, not one of 40 for every row), and
    every row as plain `generate` gives it."""
    target = make_target()
    generator = torch.Generator().manual_seed(8)
    lengths = [2, 40, 3, 36]
    input_ids = torch.stack([torch.cat([torch.full((40 - n,), PAD), torch.randint(3, 90, (n,), generator=generator)])
                             for n in lengths])
    widths = []
    handle = target.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape), with_kwargs=True)
    reference = target.generate(input_ids=input_ids, attention_mask=(input_ids != PAD).long(), do_sample=False,
                                max_new_tokens=12, pad_token_id=PAD)
    widths.clear()
    output = generate(target, input_ids=input_ids, attention_mask=(input_ids != PAD).long(), do_sample=False,
                      max_new_tokens=12, pad_token_id=PAD, assistant_model=make_drafter(target),
                      speculation_config={"step_costs": TEST_STEP_COSTS})
    handle.remove()
    assert torch.equal(output, reference)
    assert [shape for shape in widths if shape[1] > 4] == [(2, 40)] and (2, 3) in widths, widths


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_rows_under_a_memory_budget_give_the_output_of_generate(kind):
    """A budget of two and a half slots (2 rows decoded at once, the others admitted as rows finish) keeps every
    row equal to plain `generate`; a budget below one slot is refused."""
    target = make_target(kind)
    drafter = make_drafter(target)
    input_ids, mask = make_batch(7, seed=4)
    one_slot = slot_bytes(target, SpecFormerProposer(drafter, num_draft_tokens=4), input_ids.shape[1], 12)
    stats = assert_same_as_generate(target, drafter, input_ids, mask, num_draft_tokens=4, max_new_tokens=12,
                                    pad_token_id=PAD, memory_budget=int(2.5 * one_slot)).speculation_stats
    assert stats.row_steps <= 2 * stats.steps
    with pytest.raises(ValueError, match="holds no row"):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=12,
                 pad_token_id=PAD, speculation_config={"num_draft_tokens": 4, "memory_budget": one_slot - 1})


class ScriptedFeed(RowFeed):
    """Rows that join at given polls and rows cancelled at given polls; keeps what it is told, per request."""

    def __init__(self, initial: NewRow, joining: dict[int, list[NewRow]], cancelling: dict[int, list[NewRow]]):
        super().__init__([initial])
        self.joining, self.cancelling, self.polls = joining, cancelling, 0
        self.handed, self.streamed, self.finished = [initial], {}, {}

    def poll(self, idle: bool):
        if not self.joining and not self.cancelling:
            return None
        while True:  # while idle, the next poll that brings rows comes at once
            self.polls += 1
            new, cancelled = self.joining.pop(self.polls, []), self.cancelling.pop(self.polls, [])
            self.handed += new
            if new or cancelled or not idle:
                return new, cancelled

    def owner(self, row: int) -> NewRow:
        """The request the call's row `row` serves now: the latest one given it."""
        return next(request for request in reversed(self.handed) if request.row == row)

    def committed(self, rows, tokens):
        for row, ids in zip(rows, tokens):
            self.streamed.setdefault(id(self.owner(row)), []).extend(ids)

    def __call__(self, row):
        self.finished[id(self.owner(row.row))] = row.tokens


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_rows_fed_to_a_running_call_give_the_output_of_generate(kind):
    """Seven requests of their own prompt lengths and limits join a call of 3 slots at different steps (so rows of
    requests that ended are reused): each one's tokens, streamed step by step and reported at its end, are plain
    `generate`'s; of two cancelled, one running and one as it joins, the streamed tokens are a prefix of their own
    and their end is never reported."""
    target, generator = make_target(kind), torch.Generator().manual_seed(6)
    requests = [NewRow(torch.randint(3, 90, (length,), generator=generator).tolist(), limit)
                for length, limit in ((5, 12), (9, 20), (3, 6), (7, 30), (12, 9), (4, 15), (8, 11))]
    feed = ScriptedFeed(requests[0], {1: [requests[1]], 3: [requests[2]], 5: requests[3:5], 9: [requests[5]],
                                      14: [requests[6]]}, {4: [requests[1]], 14: [requests[6]]})
    width, prompt = 16, requests[0].prompt_ids
    input_ids = torch.tensor([[PAD] * (width - len(prompt)) + prompt])
    mask = (torch.arange(width) >= width - len(prompt)).long()[None]
    generate(target, input_ids=input_ids, attention_mask=mask, max_new_tokens=32, do_sample=True, temperature=1.0,
             top_k=0, top_p=1.0, sampling_seeds=[0], assistant_model=make_drafter(target), row_finished=feed,
             speculation_config={"max_batch_size": 3, "schedule": "fixed"}, pad_token_id=PAD)
    assert max(request.row for request in requests[:6]) < 5  # rows of ended requests were reused
    for i, request in enumerate(requests):
        ids = torch.tensor([request.prompt_ids])
        expected = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=request.max_new_tokens,
                                   do_sample=False, pad_token_id=PAD)[0, ids.shape[1]:].tolist()
        streamed = feed.streamed.get(id(request), [])
        if i in (1, 6):  # cancelled while running, and as it joined
            assert id(request) not in feed.finished and streamed == expected[: len(streamed)]
            assert (0 < len(streamed) < len(expected)) if i == 1 else not streamed
        else:
            assert feed.finished[id(request)] == expected == streamed, i
