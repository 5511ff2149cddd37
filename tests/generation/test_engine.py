"""Greedy speculative generation equals plain `generate`, token for token, across the engine's ragged cases."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_ONLY, TINY_VOCAB, make_companion, make_drafter, make_target
from helpers import (
    PAD, SoftOracle, assert_same_as_generate, make_batch, noisy_oracle, optimistic_table, started_batch,
)
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_specformer import OracleProposer, SpecFormerProposer, generate
from hf_specformer.generation.batch import padded_batch_size
from hf_specformer.generation.forwards import LoopLayers, cache_argument, recorded_hidden_states, target_forward
from hf_specformer.generation.linears import LinearSwitch
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
    middle = reference_new[:, reference_new.shape[1] // 3]
    ids = [int(middle[0])]
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
    kwargs = dict(max_new_tokens=max_new, pad_token_id=PAD)
    if eos is not None:
        kwargs["eos_token_id"] = eos
    new_tokens = reference[:, input_ids.shape[1]:]
    assistant = {
        "untrained": lambda: make_drafter(target, draft_length=4),
        "vocab": lambda: make_drafter(target, draft_length=4).set_draft_vocab(torch.randperm(TINY_VOCAB)[:40]),
        "oracle": lambda: OracleProposer(new_tokens, k, TINY_VOCAB, PAD),
        "noisy": lambda: noisy_oracle(new_tokens, k, TINY_VOCAB, corrupt=0.3),
    }[drafter_kind]()
    output = assert_same_as_generate(
        target, assistant, input_ids, mask, num_draft_tokens=k if drafter_kind in ("untrained", "vocab") else None,
        lookup_ngram_size=0 if drafter_kind == "oracle" else None, schedule=schedule, **kwargs
    )
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
    output = assert_same_as_generate(
        target, oracle, input_ids, mask, max_new_tokens=20, repetition_penalty=1.3, min_new_tokens=6,
        eos_token_id=eos, pad_token_id=PAD,
    )
    assert (output.sequences[:, input_ids.shape[1]: input_ids.shape[1] + 6] != eos).all()


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
    token = int(reference[2, input_ids.shape[1] + 7])
    criteria = StoppingCriteriaList([StopAfterToken(token, input_ids.shape[1])])
    oracle = OracleProposer(reference[:, input_ids.shape[1]:], 4, TINY_VOCAB, PAD)
    assert_same_as_generate(
        target, oracle, input_ids, mask, max_new_tokens=24, stopping_criteria=criteria, pad_token_id=PAD
    )


class CollectingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.flatten())

    def end(self):
        self.ended = True


def test_streamer_batch_size_one():
    target = make_target("llama")
    drafter = make_drafter(target)
    input_ids, mask = make_batch(1, seed=5, padded=False)
    streamer = CollectingStreamer()
    output = generate(
        target, input_ids=input_ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=15,
        do_sample=False, streamer=streamer,
    )
    assert streamer.ended
    assert torch.equal(torch.cat(streamer.chunks), output[0].cpu())  # a streamer is given tokens on the host


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_beams": 2}, "beam search"),
        ({"num_return_sequences": 2}, "num_return_sequences"),
        ({"cache_implementation": "static"}, "DynamicCache"),
        ({"output_scores": True}, "unsupported"),
    ],
)
def test_unsupported_arguments_raise(kwargs, message):
    target = make_target("llama")
    drafter = make_drafter(target)
    input_ids, mask = make_batch(2, seed=1)
    with pytest.raises(ValueError, match=message):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4, **kwargs)


def test_missing_attention_mask_with_padding_raises():
    target = make_target("llama")
    drafter = make_drafter(target)
    input_ids, _ = make_batch(3, seed=1)
    with pytest.raises(ValueError, match="attention_mask"):
        generate(target, input_ids=input_ids, assistant_model=drafter, max_new_tokens=4, pad_token_id=PAD)


def test_drafter_bound_to_another_target_raises():
    target, other = make_target("llama"), make_target("llama", seed=7)
    drafter = make_drafter(other)
    input_ids, mask = make_batch(2, seed=1)
    with pytest.raises(ValueError, match="another target"):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4)


def test_drafter_for_a_different_architecture_raises():
    llama, qwen = make_target("llama"), make_target("qwen3")
    drafter = make_drafter(qwen)
    drafter._target_head = None  # unbound copy of a Qwen3 drafter
    input_ids, mask = make_batch(2, seed=1)
    with pytest.raises(ValueError, match="model_type"):
        generate(llama, input_ids=input_ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4)


def test_missing_assistant_raises():
    target = make_target("llama")
    input_ids, mask = make_batch(2, seed=1)
    with pytest.raises(ValueError, match="assistant_model"):
        generate(target, input_ids=input_ids, attention_mask=mask, max_new_tokens=4)


@pytest.mark.parametrize("hole_fraction", [0.0, 0.3, 2.0], ids=["compact-every-step", "compact-at-30%", "never"])
def test_compaction_policy_does_not_change_outputs(hole_fraction):
    target = make_target("qwen3")
    input_ids, mask = make_batch(9, seed=21)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    oracle = noisy_oracle(reference[:, input_ids.shape[1]:], 4, TINY_VOCAB, corrupt=0.25, seed=3)
    assert_same_as_generate(
        target, oracle, input_ids, mask, max_new_tokens=30, pad_token_id=PAD, compaction_hole_fraction=hole_fraction
    )


@pytest.mark.parametrize(
    "kind, batch_size, k, eos_mode, threshold",
    [("llama", 1, 4, None, 0.3), ("qwen3", 6, 4, "mid", 0.3), ("llama", 16, 8, "several", 0.6),
     ("qwen3", 32, 3, "mid", 0.9)],
)
def test_confidence_threshold_verifies_fewer_drafts_with_the_same_output(kind, batch_size, k, eos_mode, threshold):
    """Rows verify different numbers of drafts per step (their cumulative draft probability against the threshold),
    and the step is as wide as its longest row; the output is still plain `generate`'s."""
    target = make_target(kind)
    input_ids, mask = make_batch(batch_size, seed=40 + batch_size)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    eos = _eos_ids(reference[:, input_ids.shape[1]:], eos_mode)
    oracle = SoftOracle(reference[:, input_ids.shape[1]:], k, TINY_VOCAB, corrupt=0.2, seed=batch_size)
    output = assert_same_as_generate(
        target, oracle, input_ids, mask, lookup_ngram_size=0, confidence_threshold=threshold, max_new_tokens=30,
        pad_token_id=PAD, **({} if eos is None else {"eos_token_id": eos}),
    )
    stats = output.speculation_stats
    assert 1 < stats.drafts_per_step < k, stats.drafts_per_step
    assert stats.accepted > 0


def tiny_gemma2() -> torch.nn.Module:
    """A tiny Gemma2: its causal-LM head soft-caps the logits, so the engine must run its whole forward."""
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=TINY_VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=12, final_logit_softcapping=5.0,
                          pad_token_id=PAD)
    return Gemma2ForCausalLM(config).double().eval()


@CPU_ONLY
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("recorded", ["all", "ends", "middle", "none"])
def test_target_forward_gives_the_models_own_logits_and_states(kind, recorded):
    """The loop's target forward, with the few-row CPU products switched on, returns what the model's own forward
    returns: its logits, and its `output_hidden_states` at the indices recorded (None at the others; Gemma2 scales
    its embeddings before the first layer, which is what index 0 holds); Gemma2 still soft-caps its logits."""
    target = tiny_gemma2() if kind == "gemma2" else make_target(kind)
    num_layers = target.config.num_hidden_layers
    indices = {"all": range(num_layers + 1), "ends": {0, num_layers}, "middle": {1}, "none": ()}[recorded]
    input_ids, mask = make_batch(2, seed=4, padded=False)  # Gemma2's eager attention gives NaN at padded positions
    engine_cache, model_cache = DynamicCache(), DynamicCache()
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    layers = LoopLayers(target, [target])
    with layers.installed(), layers.speedups():
        engine = target_forward(target, input_ids, mask, positions, engine_cache, frozenset(indices), logits_to_keep=0)
    model = target(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                   **cache_argument(target, model_cache),
                   output_hidden_states=True)
    assert not model.logits.isnan().any()
    torch.testing.assert_close(engine.logits, model.logits, rtol=0, atol=1e-10)
    assert engine_cache.get_seq_length() == model_cache.get_seq_length() == input_ids.shape[1]
    if not indices:
        assert engine.hidden_states is None
        return
    assert len(engine.hidden_states) == len(model.hidden_states) == num_layers + 1
    for index, (ours, theirs) in enumerate(zip(engine.hidden_states, model.hidden_states)):
        if index in indices:
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)
        else:
            assert ours is None


def test_recorded_hidden_states_reject_indices_outside_the_target():
    target = make_target("llama")
    with pytest.raises(ValueError, match="outside 0"):
        with recorded_hidden_states(target, {target.config.num_hidden_layers + 1}):
            pass


class RecordingProposer(SpecFormerProposer):
    """A SpecFormer proposer that records `(row id, tokens generated so far, draft logits [k, V])` per proposal."""

    def __init__(self, drafter, num_draft_tokens):
        super().__init__(drafter, num_draft_tokens)
        self.records = []

    def propose(self, batch, hidden_states, position_ids, source_index, draft=True):
        proposal = super().propose(batch, hidden_states, position_ids, source_index, draft)
        if proposal.drafted:
            self.records.extend(
                zip(batch.row_ids.tolist(), batch.num_generated[batch.row_ids].tolist(), proposal.logits)
            )
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
    output = assert_same_as_generate(target, proposer, input_ids, mask, max_new_tokens=20, pad_token_id=PAD)
    width = input_ids.shape[1]
    checked = 0
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
    kwargs = dict(max_new_tokens=max_new, pad_token_id=PAD, **({"eos_token_id": eos} if eos else {}))
    companion = make_companion(target)
    companion.config.acceptance_table = optimistic_table("sv")
    output = assert_same_as_generate(
        target, noisy_oracle(new_tokens, k, TINY_VOCAB, corrupt=0.3), input_ids, mask, lookup_ngram_size=0,
        companion_model=companion, **kwargs,
    )
    stats = output.speculation_stats
    assert sum(stats.width_counts) == stats.steps and stats.drafted > 0


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_goodput_skips_drafting_that_does_not_pay_and_stays_lossless(kind):
    """An untrained drafter's drafts are rarely right and it knows it (low confidence): the scheduler verifies
    none, stops running the drafter's slot stage (its context cache keeps growing) and probes now and then."""
    target = make_target(kind)
    input_ids, mask = make_batch(12, seed=5)
    output = assert_same_as_generate(
        target, make_drafter(target), input_ids, mask, num_draft_tokens=3, lookup_ngram_size=0, max_new_tokens=40,
        pad_token_id=PAD,
    )
    stats = output.speculation_stats
    assert stats.width_counts[0] > stats.steps // 2, stats.width_counts
    assert 0 < stats.drafting_steps < stats.steps, (stats.drafting_steps, stats.steps)


# name: (target kind, batch size, k, schedule arguments)
PACKED_CASES = {
    "llama-b9-k3-goodput": ("llama", 9, 3, {}),
    "qwen3-b16-k4-goodput": ("qwen3", 16, 4, {}),
    "llama-b12-k4-threshold": ("llama", 12, 4, {"schedule": "fixed", "confidence_threshold": 0.4}),
}


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("case", sorted(PACKED_CASES))
def test_packed_and_padded_verification_equal_generate(case, packed):
    """Drafts of varying confidence (`SoftOracle`) make rows verify different numbers of drafts (packed goodput, or
    a threshold), so steps feed padding after the shorter rows: zeros under packed verification, computed by the
    layers otherwise."""
    kind, batch_size, k, schedule = PACKED_CASES[case]
    target = make_target(kind)
    input_ids, mask = make_batch(batch_size, seed=batch_size + k, padded=True)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    proposer = SoftOracle(reference[:, input_ids.shape[1]:], k, TINY_VOCAB, corrupt=0.3)
    output = assert_same_as_generate(target, proposer, input_ids, mask, lookup_ngram_size=0, max_new_tokens=24,
                                     pad_token_id=PAD, packed_verification=packed, **schedule)
    stats = output.speculation_stats
    assert stats.drafted > 0
    if packed or schedule:  # padded goodput steps give every row with drafts the one chosen width
        assert stats.padding > 0


@pytest.mark.parametrize("num_draft_tokens", [3, 0])  # the engine's admission; transformers' loop (k = 0)
def test_the_prefill_computes_the_real_prompt_tokens_only_and_equals_generate(num_draft_tokens, monkeypatch):
    """The prefill's linear layers see each row's real prompt tokens only (packed), and the output is still
    `generate`'s; with `packed_verification=False` they see the padded rectangle."""
    target = make_target("llama")
    input_ids, mask = make_batch(6, seed=5, padded=True)
    first_layer = target.model.layers[0].self_attn.q_proj
    rows = []
    product = LinearSwitch._product

    def counted_product(self, layer, inner, max_rows, x):
        if layer is first_layer:
            rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return product(self, layer, inner, max_rows, x)

    monkeypatch.setattr(LinearSwitch, "_product", counted_product)
    drafter = make_drafter(target)
    assert int(mask.sum()) < mask.numel()
    for packed, prefill_rows in ((True, int(mask.sum())), (False, mask.numel())):
        rows.clear()
        assert_same_as_generate(target, drafter, input_ids, mask, num_draft_tokens=num_draft_tokens,
                                packed_verification=packed, max_new_tokens=12, pad_token_id=PAD)
        assert rows[0] == prefill_rows


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


@pytest.mark.parametrize(
    "kwargs, message",
    [({"schedule": "adaptive"}, "schedule"), ({"schedule": "goodput", "confidence_threshold": 0.3}, "fixed"),
     ({"schedule": "fixed", "companion": True}, "companion"), ({"companion": "drafter"}, "CompanionForVerification")],
)
def test_schedule_arguments_are_checked(kwargs, message):
    target = make_target("llama")
    input_ids, mask = make_batch(2)
    kwargs = dict(kwargs)
    if kwargs.pop("companion", None) is not None:
        kwargs["companion_model"] = make_drafter(target) if message == "CompanionForVerification" \
            else make_companion(target)
    with pytest.raises(ValueError, match=message):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                 max_new_tokens=3, **kwargs)


class RowCountWitness(OracleProposer):
    """The oracle, recording how many rows the engine keeps each time it drops finished ones."""

    def start(self, capacity: int) -> None:
        super().start(capacity)
        self.kept = []

    def select_rows(self, keep: torch.LongTensor) -> None:
        self.kept.append(keep.numel())
        super().select_rows(keep)


def test_padded_batch_size():
    assert [padded_batch_size(n) for n in range(11)] == [0, 1, 2, 4, 4, 8, 8, 8, 8, 16, 16]
    assert [padded_batch_size(n) for n in (17, 24, 25, 64)] == [24, 24, 32, 64]


def test_rows_to_keep_keeps_finished_rows_as_padding_up_to_the_padded_size():
    batch = started_batch(torch.ones(8, 2, dtype=torch.long), None, capacity=4, pad_token_id=PAD)
    batch.finished = torch.tensor([0, 1, 0, 0, 1, 0, 0, 0], dtype=torch.bool)  # 6 live: stays at 8
    batch.refresh(torch.Tensor.cpu)
    assert batch.rows_to_keep() is None
    batch.finished = torch.tensor([0, 1, 1, 0, 1, 1, 0, 1], dtype=torch.bool)  # 3 live: 4 rows, the first finished
    batch.refresh(torch.Tensor.cpu)
    assert batch.rows_to_keep().tolist() == [0, 1, 3, 6]
    batch.finished = torch.ones(8, dtype=torch.bool)
    batch.refresh(torch.Tensor.cpu)
    assert batch.rows_to_keep().tolist() == []


def test_finished_rows_stay_as_padding_commit_nothing_and_are_not_counted():
    """Rows of a batch of 8 end at different steps (EOS); the engine drops them only when the batch falls to 4, 2, 1
    and 0 rows. Padding rows verify nothing and are no row-steps: with every oracle draft right, each row's kappa is
    exactly k + 1."""
    target = make_target("llama")
    input_ids, mask = make_batch(8, seed=11, padded=True)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    new_tokens = reference[:, input_ids.shape[1]:]
    eos = sorted({int(new_tokens[row, 3 * row + 1]) for row in range(8)})  # every row ends well before 40 tokens
    k = 2
    witness = RowCountWitness(new_tokens, k, TINY_VOCAB, PAD)
    output = assert_same_as_generate(target, witness, input_ids, mask, lookup_ngram_size=0, max_new_tokens=40,
                                     pad_token_id=PAD, eos_token_id=eos, schedule="fixed")
    assert witness.kept and set(witness.kept) <= {4, 2, 1, 0}, witness.kept
    assert output.speculation_stats.tokens_per_row_step == [k + 1] * 8
