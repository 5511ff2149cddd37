"""What the benchmark measures: chat batches and their new tokens, the prefill and the cost-model limit of one
batch size, and one mode's tallies over its batches (`ModeTally`); `bench.py` runs them side by side."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .generation.forwards import LoopLayers, cache_argument, target_forward
from .models.specformer import SpecFormerConfig
from .targets import synchronize, timed
from .ties import classify_rows


def chat_batches(tokenizer, prompts: list[str], batch_size: int) -> list[dict]:
    """Left-padded chat-template batches of `batch_size` prompts (the last partial batch is dropped)."""
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    return [
        tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True)
        for i in range(0, len(texts) - batch_size + 1, batch_size)
    ]


def count_new_tokens(sequences: torch.LongTensor, prompt_width: int, eos_token_id: int) -> int:
    """New tokens per row up to and including the first EOS (padding after it is not counted)."""
    new = sequences[:, prompt_width:]
    is_eos = new == eos_token_id
    lengths = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, torch.full_like(new[:, 0], new.shape[1]))
    return int(lengths.sum())


@torch.no_grad()
def prefill_seconds(target, batch: dict) -> float:
    """Time of the prompt forward `generate` starts with (fresh cache, logits of the last position only)."""
    return timed(lambda: target(**batch, **cache_argument(target, DynamicCache()), logits_to_keep=1), target.device)[1]


@torch.no_grad()
def forward_cost_limit(target, context: torch.LongTensor, attention_mask: torch.Tensor, k: int, repeats: int) -> dict:
    """(k + 1) * t(B, 1) / t(B, k + 1): the speedup of all-accepted drafts if drafting and bookkeeping were free.

    t(B, 1) is the target's own forward of one new token per row (what plain `generate` runs); t(B, k + 1) the
    engine's verification forward of k + 1 tokens per row (`target_forward` with `LoopLayers` sped up, with the hidden
    states a drafter reads).
    Timed over a realistic cache: `context` `[B, C]` is the prompt plus the first half of the plain continuation
    (the mean cache length while decoding). The two forwards alternate, `repeats` times each, and the medians are
    used, so drift on a shared machine hits both alike.
    """
    cache = DynamicCache()
    target(input_ids=context, attention_mask=attention_mask, **cache_argument(target, cache), logits_to_keep=1)
    lengths = attention_mask.sum(-1, keepdim=True)
    layers = LoopLayers(target, [target])
    hooked = frozenset(SpecFormerConfig.from_target_config(target.config).hook_layers)
    times = {1: [], k + 1: []}
    for _ in range(repeats):
        for num_tokens in times:
            ids = context[:, -num_tokens:]
            mask = torch.cat([attention_mask, torch.ones_like(ids)], 1)
            positions = lengths + torch.arange(num_tokens, device=context.device)
            synchronize(context.device)
            start = time.perf_counter()
            if num_tokens == 1:
                target(ids, attention_mask=mask, position_ids=positions, logits_to_keep=0,
                       **cache_argument(target, cache))
            else:
                with layers.installed(), layers.speedups():
                    target_forward(target, ids, mask, positions, cache, hooked, logits_to_keep=0)
            synchronize(context.device)
            times[num_tokens].append(time.perf_counter() - start)
            cache.crop(-num_tokens)
    t1, tk = statistics.median(times[1]), statistics.median(times[k + 1])
    return {"t_forward_1": t1, "t_forward_k_plus_1": tk, "limit": (k + 1) * t1 / tk}


@dataclass
class ModeTally:
    """One mode's sums over the batches of a batch size."""

    seconds: float = 0.0
    mismatched_rows: int = 0
    mismatches: list[dict] = field(default_factory=list)
    kappas: list[float] = field(default_factory=list)
    drafts_per_step: list[float] = field(default_factory=list)
    per_position: list[list[float]] = field(default_factory=list)

    stats: list[dict] = field(default_factory=list)

    def add(self, output, seconds: float, reference: torch.LongTensor, target, batch: dict, pad_token_id) -> None:
        """One batch's run; every row that differs from plain decoding is classified (`ties.py`)."""
        self.seconds += seconds
        found = classify_rows(target, batch["input_ids"], batch["attention_mask"], reference, output.sequences,
                              pad_token_id)
        self.mismatched_rows += len(found)
        self.mismatches.extend(mismatch.to_dict() for mismatch in found)
        self.kappas.append(output.speculation_stats.tokens_per_step)
        self.drafts_per_step.append(output.speculation_stats.drafts_per_step)
        self.per_position.append(output.speculation_stats.acceptance_by_position)
        self.stats.append(output.speculation_stats.to_dict())

    def summary(self) -> dict:
        """Means over batches of what the schedule chose and how well it predicted."""
        width_counts = [sum(column) for column in zip(*(s["width_counts"] for s in self.stats))]
        drafted, padding = sum(s["drafted"] for s in self.stats), sum(s["padding"] for s in self.stats)
        steps = max(sum(s["steps"] for s in self.stats), 1)
        engine = [s for s in self.stats if not s["plain_decoding"]]  # calls in transformers' loop time no steps

        def per_step(key: str) -> list[float]:
            counts = [sum(s["width_counts"][w] for s in engine) for w in range(len(width_counts))]
            totals = [sum(s[key][w] * s["width_counts"][w] for s in engine) for w in range(len(width_counts))]
            return [total / max(count, 1) for total, count in zip(totals, counts)]

        return {
            "width_counts": width_counts,
            "seconds_per_step_by_width": per_step("seconds_per_step_by_width"),
            "predicted_seconds_per_step_by_width": per_step("predicted_seconds_per_step_by_width"),
            "handoffs": sum(s["handoffs"] for s in self.stats),
            "host_reads_per_step": sum(s["host_reads"] for s in engine) / max(sum(s["steps"] for s in engine), 1),
            "mean_width": sum(w * n for w, n in enumerate(width_counts)) / max(sum(width_counts), 1),
            "predicted_acceptance_rate": sum(s["predicted_acceptance_rate"] * s["drafted"] for s in self.stats)
            / max(drafted, 1),
            "acceptance_rate": sum(s["accepted"] for s in self.stats) / max(drafted, 1),
            "drafting_steps_share": sum(s["drafting_steps"] for s in self.stats) / steps,
            "plain_decoding_share": sum(s["plain_decoding"] for s in self.stats) / max(len(self.stats), 1),
            "padding_share": padding / max(padding + drafted + sum(s["row_steps"] for s in self.stats), 1),
            "tie_rows": sum(m["tie"] for m in self.mismatches),
            "true_bug_rows": sum(not m["tie"] for m in self.mismatches),
            "mismatches": self.mismatches,
        }
