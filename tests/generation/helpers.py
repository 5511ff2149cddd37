"""Shared checks for the generation tests: batches, oracle proposers, and equality against plain `generate`."""

from __future__ import annotations

import torch
from conftest import TEST_DEVICE

from hf_specformer import OracleProposer, Proposal, generate
from hf_specformer.generation.acceptance import (
    NUM_SOURCES,
    PRIOR_TRIALS,
    SIGNALS,
    AcceptanceTable,
)
from hf_specformer.generation.batch import RaggedBatch
from hf_specformer.generation.costs import StepCostModel
from hf_specformer.generation.feedback import StepClock

PAD = 0

TEST_STEP_COSTS = StepCostModel(
    batch_sizes=[1, 64],
    step_seconds=[[1.0 + 0.4 * w for w in range(9)], [64.0 * (1.0 + 0.4 * w) for w in range(9)]],
    draft_seconds=[0.05, 3.2],
    description={"what": "test costs: t(B, w) = B (1 + 0.4 w), t_d(B) = 0.05 B"},
)
"""Made-up step costs for the goodput scheduler in tests: deterministic (measured costs of tiny models are noise),
and with this slope a row's drafts are verified only when their estimated acceptance is high, so tests see plain
steps, narrow and full-width steps, and skipped drafting."""


def optimistic_table(signal: str, num_slots: int = 8) -> dict:
    """A calibrated-table dict that expects 90% acceptance everywhere, at the largest prior weight: the goodput
    scheduler starts by verifying every draft, then online counts bring the estimates to what it observes."""
    features = SIGNALS[signal]
    shape = (NUM_SOURCES, num_slots, *([2] * features))
    table = AcceptanceTable(signal, [[0.5]] * features, num_slots, torch.full(shape, 0.9),
                            torch.full(shape, PRIOR_TRIALS))
    return table.to_dict()


def make_batch(batch_size: int, seed: int = 0, padded: bool = True, min_len: int = 3, max_len: int = 14):
    """Left-padded random prompts `[B, P]` with their attention mask, on `TEST_DEVICE`; lengths differ per row when
    `padded`."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch_size,), generator=generator) if padded else None
    width = max_len if padded else max_len
    input_ids = torch.randint(3, 90, (batch_size, width), generator=generator)
    mask = torch.ones_like(input_ids)
    if padded:
        for row, length in enumerate(lengths.tolist()):
            input_ids[row, : width - length] = PAD
            mask[row, : width - length] = 0
    return input_ids.to(TEST_DEVICE), mask.to(TEST_DEVICE)


def started_batch(input_ids: torch.LongTensor, attention_mask, capacity: int, pad_token_id: int = PAD) -> RaggedBatch:
    """A `RaggedBatch` of every row of `input_ids` (`[B, P]`), admitted as the engine admits them, before their
    prefill."""
    batch = RaggedBatch.start(input_ids, attention_mask, capacity, pad_token_id)
    batch.join(batch.admission(torch.arange(input_ids.shape[0], device=input_ids.device), input_ids.shape[1]))
    return batch


def committed_batch(rows: list[list[int]], pad: int = PAD) -> RaggedBatch:
    """A batch whose rows have committed exactly `rows` (left-padded prompts of different lengths, nothing
    generated), with junk in the scratch space after each row so a match can never read it."""
    width = max(map(len, rows))
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    batch = started_batch(input_ids, mask, capacity=8, pad_token_id=pad)
    batch.tokens[:, width:] = 99
    return batch


def noisy_oracle(reference_new_tokens: torch.LongTensor, k: int, vocab: int, corrupt: float, seed: int = 0):
    """An oracle whose continuation has a share `corrupt` of tokens replaced, so rows reject at different places."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.rand(reference_new_tokens.shape, generator=generator) < corrupt
    random_tokens = torch.randint(3, vocab, reference_new_tokens.shape, generator=generator)
    noisy = torch.where(noise.to(reference_new_tokens.device), random_tokens.to(reference_new_tokens.device),
                        reference_new_tokens)
    return OracleProposer(noisy, k, vocab, PAD)


class SoftOracle(OracleProposer):
    """A noisy oracle whose draft logits are a random margin (0..8) on the draft token rather than one-hot, so the
    drafts' probabilities, and with a confidence threshold the number of drafts each row verifies, vary by row
    and step."""

    def __init__(self, reference_new_tokens: torch.LongTensor, k: int, vocab: int, corrupt: float, seed: int = 0):
        noisy = noisy_oracle(reference_new_tokens, k, vocab, corrupt, seed)
        super().__init__(noisy.continuations[:, :-(k + 1)], k, vocab, PAD)
        self.generator = torch.Generator().manual_seed(seed + 1)

    def propose(self, batch, hidden_states, position_ids, source_index, draft=True) -> Proposal:
        one_hot = super().propose(batch, hidden_states, position_ids, source_index, draft).logits
        if one_hot is None:
            return Proposal()
        margin = torch.rand(one_hot.shape[:2], generator=self.generator, dtype=one_hot.dtype).to(one_hot.device) * 8
        return Proposal(torch.where(one_hot.isinf(), 0.0, margin[..., None]))


def assert_same_as_generate(
    target, assistant, input_ids, attention_mask, num_draft_tokens=None, compaction_hole_fraction=0.5,
    lookup_ngram_size=None, confidence_threshold=None, schedule=None, step_costs=TEST_STEP_COSTS,
    companion_model=None, packed_verification=None, cost_feedback=None, suffix_index=None, max_batch_size=None,
    memory_budget=None, alternative_draft=None, num_alternatives=None, **kwargs
):
    """Speculative output equals `target.generate` token for token; returns the speculative output.
    `None` keeps `generate`'s defaults (the goodput schedule, here with `TEST_STEP_COSTS` taken as they are, so the
    scheduler's choices do not depend on timings; `cost_feedback=True` learns them from the steps)."""
    if cost_feedback is None:
        cost_feedback = step_costs is None
    speculative_only = {
        "lookup_ngram_size": lookup_ngram_size, "confidence_threshold": confidence_threshold, "schedule": schedule,
        "step_costs": step_costs, "companion_model": companion_model, "packed_verification": packed_verification,
        "cost_feedback": cost_feedback, "suffix_index": suffix_index, "max_batch_size": max_batch_size,
        "memory_budget": memory_budget, "alternative_draft": alternative_draft, "num_alternatives": num_alternatives,
    }
    kwargs_spec = {name: value for name, value in speculative_only.items() if value is not None}
    reference = target.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, **kwargs)
    output = generate(
        target, input_ids=input_ids, attention_mask=attention_mask, assistant_model=assistant, do_sample=False,
        return_dict_in_generate=True, num_draft_tokens=num_draft_tokens,
        compaction_hole_fraction=compaction_hole_fraction, **kwargs_spec, **kwargs,
    )
    assert output.sequences.shape == reference.shape, (output.sequences.shape, reference.shape)
    mismatched = (output.sequences != reference).any(dim=1).nonzero().flatten().tolist()
    assert not mismatched, f"rows {mismatched} differ:\n{output.sequences[mismatched]}\n{reference[mismatched]}"
    return output


def char_tokenizer():
    """A tokenizer for the tiny models: id i (3..95) is the character chr(30 + i), 0/1/2 are pad/BOS/EOS, so stop
    strings can be written over any token sequence (`StopStringCriteria` needs a real tokenizer)."""
    from tokenizers import Regex, Tokenizer
    from tokenizers.decoders import Fuse
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": 1, "</s>": 2, **{chr(30 + i): i for i in range(3, 96)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = Split(Regex("."), behavior="isolated")
    tokenizer.decoder = Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


class SimulatedClock(StepClock):
    """Seconds that depend on a step's work alone, not on the machine's load: a step costs 1 s plus 0.1 s per
    verified draft, drafting 0.3 s (what learnt costs then converge to, whatever else runs beside the test)."""

    def read(self) -> list[tuple[tuple, list[float]]]:
        timed = super().read()
        return [(label, [1.0 + 0.1 * label[3][0], 0.3 if label[5] else 0.0]) for label, _ in timed]
