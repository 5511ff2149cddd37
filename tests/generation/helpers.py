"""Shared checks for the generation tests: batches, oracle proposers, and equality against plain `generate`."""

from __future__ import annotations

import torch
from conftest import TEST_DEVICE

from hf_specformer import OracleProposer, Proposal, StepCosts, generate
from hf_specformer.generation.acceptance import NUM_SOURCES, PRIOR_TRIALS, SIGNALS, AcceptanceTable
from hf_specformer.generation.batch import RaggedBatch

PAD = 0

TEST_STEP_COSTS = StepCosts(plain=1.0, per_input=0.4, draft=0.05, learn=False)
"""Made-up step costs for the goodput scheduler in tests, t(B, w) = B (1 + 0.4 w) and t_d(B) = 0.05 B: deterministic
(measured costs of tiny models are noise), and with this slope a row's drafts are verified only when their estimated
acceptance is high, so tests see plain steps, narrow and full-width steps, and skipped drafting."""


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


def started_batch(input_ids: torch.LongTensor, attention_mask, capacity: int, pad_token_id: int = PAD,
                  max_new_tokens: int | None = None) -> RaggedBatch:
    """A `RaggedBatch` of every row of `input_ids` (`[B, P]`), admitted as the engine admits them, with their prompt
    columns committed (as after their prefill); `capacity` new tokens fit after the prompt, `max_new_tokens` (default:
    `capacity`) may be generated per row."""
    rows = input_ids.shape[0]
    batch = RaggedBatch.start(input_ids, attention_mask, max_new_tokens or capacity, capacity, rows,
                              input_ids.shape[1] + 2 * capacity, pad_token_id)
    new = batch.admission(list(range(rows)))
    new.commit_prompt()
    batch.join(new)
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

    def propose(self, batch, step, caches, draft=True, free=True) -> Proposal:
        if not draft:
            return Proposal()
        ids = self.draft_ids(batch)
        margin = torch.rand(ids.shape, generator=self.generator, dtype=torch.float64).to(ids.device) * 8
        logits = torch.zeros(*ids.shape, self.vocab_size, dtype=torch.float64, device=ids.device)
        return Proposal(logits.scatter_(2, ids[..., None], margin[..., None]))


SPECULATION_FIELDS = ("lookup_ngram_size", "schedule", "confidence_threshold", "step_costs", "suffix_index",
                      "max_batch_size", "memory_budget", "compaction_hole_fraction", "kernel_backend",
                      "num_draft_tokens")


def assert_same_as_generate(target, assistant, input_ids, attention_mask, step_costs=TEST_STEP_COSTS, **kwargs):
    """Speculative output equals `target.generate` token for token; returns the speculative output. `kwargs` named
    in `SPECULATION_FIELDS` go into the `SpeculationConfig` (None: its default), the rest to both calls; the goodput
    schedule runs on `TEST_STEP_COSTS` unless `step_costs` says otherwise (None: learnt from the steps)."""
    speculation = {name: kwargs.pop(name) for name in SPECULATION_FIELDS if name in kwargs}
    speculation = {name: value for name, value in {**speculation, "step_costs": step_costs}.items()
                   if value is not None}
    ours = {name: kwargs.pop(name) for name in ("companion_model", "sampling_seeds", "row_finished") if name in kwargs}
    reference = target.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, **kwargs)
    output = generate(target, input_ids=input_ids, attention_mask=attention_mask, assistant_model=assistant,
                      do_sample=False, return_dict_in_generate=True, speculation_config=speculation, **ours, **kwargs)
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
