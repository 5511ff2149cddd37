"""The speculative decoding loop: prefill, then per step feed, verify, commit, draft, retire rows.

Fused as in the SpecFormer paper: each step feeds every active row's last committed token plus its drafts through
the target in one forward ([B, w + 1] inputs, w <= k chosen by the schedule, `scheduling.py`; w = 0 is a plain
decoding step); the same forward's hidden states feed the proposer, which drafts the next k tokens from each row's
last accepted position, or with the goodput schedule only when drafting is expected to pay. Under the goodput
schedule each step's drafts are scored by an `AcceptanceEstimator` (`acceptance.py`): from the drafter's own
confidence, or from a companion model's distribution at each drafted position (Speculative Verification), and
every step's outcomes update its table. No acceptance math here (`verification.py`), no ragged bookkeeping
(`batch.py`), no drafting (`drafting.py`).

`speculative_decode` has the signature of a `generate` decoding method, so `GenerationMixin.generate` prepares
inputs, the cache, logits processors and stopping criteria exactly as for plain decoding and then calls it
(`custom_generate=<callable>`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .acceptance import (
    DRAFTER,
    LOOKUP,
    SIGNALS,
    AcceptanceEstimator,
    AcceptanceTable,
    draft_features,
    uniform_edges,
)
from .attention import GroupedQueryAttention
from .batch import RaggedBatch
from .caching import PreallocatedCache
from .drafting import Proposal, Proposer
from .feedback import StepClock
from .host import HostReads
from .packing import PackedLinears
from .processing import RaggedLogitsProcessor
from .products import FewRowLinears
from .scheduling import (
    CONFIDENCE_THRESHOLD,
    PROFILE_CONTEXT,
    FixedSchedule,
    GoodputSchedule,
    StepCostModel,
    cached_step_costs,
    profile_step_costs,
    step_costs_path,
)
from .stats import SpecStats
from .verification import verify_greedy, verify_sampling

COMPACTION_HOLE_FRACTION = 0.5
"""Default share of cache columns that compaction would remove (holes of rejected drafts or padding shared by every
row) at which the caches are compacted."""

SCHEDULES = ("goodput", "fixed")
"""`schedule=` values: the goodput scheduler, or every row verifying k drafts (or up to `confidence_threshold`)."""

DEFAULT_NUM_BINS = 10
"""Bins per signal of an uncalibrated acceptance table."""

@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `speculation_stats` (a `SpecStats`)."""

    speculation_stats: SpecStats | None = None


class _Committer:
    """Appends committed tokens to rows, cutting them at EOS, at max_new_tokens and at extra stopping criteria.

    `EosTokenCriteria` and `MaxLengthCriteria` are handled here token by token, vectorised; any other criterion
    (stop strings, user criteria) is evaluated on each row's prefix after every committed token, so a row stops at
    exactly the token where plain `generate` would have stopped.
    """

    def __init__(self, stopping_criteria, generation_config: GenerationConfig, max_new_tokens: int, streamer):
        self.extra_criteria = StoppingCriteriaList(
            c for c in stopping_criteria or [] if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))
        )
        self.eos_token_ids = generation_config._eos_token_tensor
        self.pad_token_id = _pad_token_id(generation_config)
        self.max_new_tokens = max_new_tokens
        self.streamer = streamer

    def __call__(self, batch: RaggedBatch, tokens: torch.LongTensor, counts: torch.LongTensor) -> torch.BoolTensor:
        """tokens `[B, n]`, counts `[B]` (1..n) -> finished `[B]`; writes the kept tokens into `batch`. Rows already
        `batch.finished` commit nothing."""
        offsets = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
        finished = batch.finished.clone()
        counts = counts.masked_fill(finished, 0)
        if self.eos_token_ids is not None:
            is_eos = torch.isin(tokens, self.eos_token_ids.to(tokens.device)) & (offsets < counts[:, None])
            first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, counts)
            finished |= is_eos.any(1)
            counts = torch.minimum(counts, first_eos)
        remaining = self.max_new_tokens - batch.num_generated[batch.row_ids]
        finished |= counts >= remaining
        counts = torch.minimum(counts, remaining)
        if self.extra_criteria:
            batch.write(tokens)
            counts, finished = self._apply_extra_criteria(batch, counts, finished)
        batch.commit_tokens(tokens.masked_fill(offsets >= counts[:, None], self.pad_token_id), counts)
        if self.streamer is not None:
            self.streamer.put(tokens[0, : int(counts[0])].cpu())
        return finished

    def _apply_extra_criteria(self, batch, counts, finished):
        prefix = batch.prefix_lengths()
        stopped = torch.zeros_like(finished)
        for j in range(1, int(counts.max()) + 1):
            candidates = (~stopped & (counts >= j)).nonzero().squeeze(1)
            for length in (prefix[candidates] + j).unique().tolist():
                rows = candidates[prefix[candidates] + j == length]
                hit = self.extra_criteria(batch.tokens[batch.row_ids[rows], :length], None).to(rows.device)
                stopped[rows[hit]] = True
                counts[rows[hit]] = j
        return counts, finished | stopped


def _pad_token_id(generation_config: GenerationConfig) -> int:
    pad = generation_config._pad_token_tensor
    return int(pad) if pad is not None else 0


def _select_tokens(scores: torch.Tensor, do_sample: bool) -> torch.LongTensor:
    """scores `[B, V]` -> `[B]`: argmax, or a sample of softmax(scores)."""
    if not do_sample:
        return scores.argmax(-1)
    return torch.multinomial(scores.softmax(-1), 1).squeeze(1)


def _draft(batch: RaggedBatch, processor: RaggedLogitsProcessor, proposal: Proposal, do_sample: bool,
           needs_probs: bool) -> tuple[torch.LongTensor, torch.LongTensor, torch.Tensor | None]:
    """A proposal -> draft ids `[B, k]` (written as scratch after each row's prefix), their sources `[B, k]`, and the
    processed probabilities `[B, k, V]` of the network's drafts (None when it did not draft, or without
    `needs_probs`). A network draft at slot j is processed with the prefix committed + drafts 1..j-1, one slot at a
    time when a processor reads the prefix; fixed drafts (lookup) take the place of the network's where their source
    says so, unprocessed."""
    sources = proposal.sources
    if sources is None:
        sources = torch.full(proposal.logits.shape[:2], DRAFTER, dtype=torch.long, device=proposal.logits.device)
    fixed = (sources == LOOKUP) if proposal.ids is not None else None
    if not proposal.drafted:
        batch.write(proposal.ids)
        return proposal.ids, sources, None

    def select(scores: torch.Tensor, slots: slice) -> torch.LongTensor:
        ids = _select_tokens(scores.flatten(0, 1), do_sample).view(scores.shape[:2])
        return ids if fixed is None else torch.where(fixed[:, slots], proposal.ids[:, slots], ids)

    if not processor.reads_prefix:
        scores = processor(batch, proposal.logits)  # [B, k, V]
        draft_ids = select(scores, slice(None))
        batch.write(draft_ids)
    else:
        ids, all_scores = [], []
        for j in range(proposal.logits.shape[1]):
            all_scores.append(processor(batch, proposal.logits[:, j : j + 1], offset=j))
            ids.append(select(all_scores[-1], slice(j, j + 1)))
            batch.write(ids[-1], offset=j)
        draft_ids, scores = torch.cat(ids, dim=1), torch.cat(all_scores, dim=1)
    return draft_ids, sources, scores.softmax(-1) if needs_probs else None


def _draft_distributions(draft_ids: torch.LongTensor, sources: torch.LongTensor, draft_probs: torch.Tensor | None,
                         vocab_size: int) -> torch.Tensor:
    """q `[B, w, V]` of the verified drafts `[B, w]` for rejection sampling: the network's processed probabilities,
    one-hot for fixed (looked-up) drafts."""
    one_hot = torch.nn.functional.one_hot(draft_ids, vocab_size).float()
    if draft_probs is None:
        return one_hot
    width = draft_ids.shape[1]
    return torch.where((sources[:, :width] == LOOKUP)[..., None], one_hot, draft_probs[:, :width])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _random_cache(config, batch_size: int, length: int, capacity: int, dtype, device) -> PreallocatedCache:
    """A `PreallocatedCache` of `length` random key/value columns per row in every layer (for timing only)."""
    config = config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (batch_size, getattr(config, "num_key_value_heads", config.num_attention_heads), length, head_dim)
    cache = PreallocatedCache(config.num_hidden_layers, capacity)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device),
                     layer)
    return cache


def measure_step_costs(model, proposer: Proposer, patches, batch_sizes: list[int], max_width: int) -> StepCostModel:
    """Times, over a cache of `PROFILE_CONTEXT` random columns at each batch size: the loop's target forward of
    w + 1 inputs per row (w = 0..max_width, with the hidden states the proposer reads and the float32 argmax of its
    logits) inside `patches()` (the loop's CPU speed-ups); the proposer's drafting, likewise; and plain decoding's
    forward of one input per row, outside them (what `_plain_decode` runs)."""
    device, vocab = model.device, model.config.get_text_config().vocab_size
    caches = {}

    def forward(batch_size: int, width: int, hidden_states: bool) -> None:
        if batch_size not in caches:
            caches.clear()
            caches[batch_size] = _random_cache(model.config, batch_size, PROFILE_CONTEXT,
                                               PROFILE_CONTEXT + max_width + 1, model.dtype, device)
        cache = caches[batch_size]
        ids = torch.randint(vocab, (batch_size, width + 1), device=device)
        mask = torch.ones(batch_size, PROFILE_CONTEXT + width + 1, dtype=torch.long, device=device)
        positions = PROFILE_CONTEXT + torch.arange(width + 1, device=device).expand(batch_size, -1)
        output = target_forward(model, ids, mask, positions, cache, hidden_states, 0)
        output.logits.float().argmax(-1)
        cache.crop(-(width + 1))

    def step(batch_size: int, width: int) -> None:
        with patches():
            forward(batch_size, width, proposer.requires_hidden_states)

    def draft(batch_size: int) -> None:
        with patches():
            proposer.profile_draft(batch_size)

    return profile_step_costs(step, draft, batch_sizes, max_width, lambda: _synchronize(device),
                              plain=lambda batch_size: forward(batch_size, 0, False))


def step_cost_description(model, proposer: Proposer, cpu_speedups: bool) -> dict:
    """What the step costs depend on: the target's configuration, dtype, device, threads, the proposer and whether
    the CPU speed-ups run."""
    device = model.device
    return {
        "target": model.config.get_text_config().to_diff_dict(),
        "dtype": str(model.dtype),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "torch": torch.__version__,
        "attention": model.config._attn_implementation,
        "proposer": proposer.cost_description(),
        "context": PROFILE_CONTEXT,
        "cpu_speedups": cpu_speedups,
    }


def _step_cost_profile(model, proposer, patched: bool, batch_size: int, step_costs) -> StepCostModel | None:
    """The step costs given, or those cached for this machine if they cover the batch; None: none (the goodput
    scheduler then learns them from the call's own steps, `_remember_costs`; a call never profiles)."""
    if step_costs is not None:
        return StepCostModel.from_value(step_costs)
    description = step_cost_description(model, proposer, patched)
    return cached_step_costs(description, batch_size, proposer.num_draft_tokens)


def _remember_costs(plan, model, proposer, patched: bool, batch_size: int) -> None:
    """Caches the step costs a goodput call learnt without a profile (`OnlineStepCosts.learnt`), for the batch sizes
    whose plain steps it timed, so the next call at those sizes can choose between the engine and plain decoding
    before it starts (`StepCostModel.covers`: other sizes learn anew)."""
    if not isinstance(plan, GoodputSchedule) or not plan.feedback or not plan.costs.learnt:
        return
    description = step_cost_description(model, proposer, patched)
    path = step_costs_path(description)
    try:
        older = StepCostModel.load(path) if path.exists() else None
    except ValueError:
        older = None
    learnt = StepCostModel.learnt(plan.costs, sorted(plan.costs.plain_batch_sizes), proposer.num_draft_tokens,
                                  description)
    learnt.merged_into(older).save(path)


def _make_schedule(schedule, num_draft_tokens, confidence_threshold, profile, expected_accepted, packed, feedback):
    """The schedule object for `schedule` ("goodput" or "fixed")."""
    if schedule == "fixed":
        return FixedSchedule(num_draft_tokens, confidence_threshold)
    if profile is None and not feedback:
        raise ValueError("cost_feedback=False needs step costs: pass `step_costs=` (none are cached for this setup).")
    return GoodputSchedule(profile, num_draft_tokens, expected_accepted, packed=packed, feedback=feedback)


def _make_estimator(acceptance_table: dict | AcceptanceTable | None, companion, num_slots: int):
    """The table given (a saved dict or a table), else an uncalibrated one for the signal available."""
    if isinstance(acceptance_table, AcceptanceTable):
        return AcceptanceEstimator(acceptance_table)
    if acceptance_table is not None:
        return AcceptanceEstimator(AcceptanceTable.from_dict(acceptance_table))
    signal = "sv" if companion is not None else "confidence"
    edges = [uniform_edges(DEFAULT_NUM_BINS)] * SIGNALS[signal]
    return AcceptanceEstimator(AcceptanceTable(signal, edges, num_slots))


def _companion_probs(companion, source_states: torch.Tensor, last_committed, draft_ids) -> torch.Tensor:
    """P_c `[B, k, V]` at the drafted positions: the companion reads the target's last hidden state at each row's
    last accepted input `[B, d]` and the chain (committed token, d_1 .. d_{k-1}) `[B, k]`."""
    chain = torch.cat([last_committed[:, None], draft_ids[:, :-1]], dim=1)
    return companion(hidden_states=source_states, input_ids=chain).logits.float().softmax(-1)


def _source_states(output, index: torch.LongTensor) -> torch.Tensor:
    """The target's last hidden state `[B, d]` at input `index[b]` of each row."""
    last = output.hidden_states[-1]
    return last[torch.arange(last.shape[0], device=last.device), index]


def _plan_step(batch, processor, proposal, do_sample, plan, estimator, companion, source_states, last_committed,
               reads: HostReads):
    """This step's drafts and how many of them each row verifies, chosen on the host after one read (`reads`) of
    the estimates (none without drafts, or for a fixed schedule without a threshold).

    Returns draft ids `[B, k]` (`[B, 0]` without drafts), their sources `[B, k]`, the processed probabilities of the
    network's drafts `[B, k, V]` (None when it did not draft, or when neither sampling nor the schedule reads them),
    drafts verified per row `[B]` on the host (finished rows' counts are masked on the device) and the estimated
    chance that drafts 1..j are all accepted `[B, k]` (None without an estimator)."""
    if proposal is None or proposal.empty:  # nothing proposed: a plain decoding step
        none = torch.zeros(batch.size, 0, dtype=torch.long, device=last_committed.device)
        return none, none, None, torch.zeros(batch.size, dtype=torch.long), None
    needs_probs = do_sample or estimator is not None or plan.needs_confidence
    draft_ids, sources, draft_probs = _draft(batch, processor, proposal, do_sample, needs_probs)
    if estimator is None:
        if plan.needs_confidence:
            confidence = draft_features("confidence", draft_probs, draft_ids, sources, sampled=do_sample)[..., 0]
            scores = reads(confidence.masked_fill(batch.finished[:, None], 0.0))
        else:  # every row verifies k: nothing to read
            scores = torch.ones(draft_ids.shape)
        return draft_ids, sources, draft_probs, plan.choose(scores, proposal.drafted), None
    companion_probs = (
        _companion_probs(companion, source_states, last_committed, draft_ids) if estimator.signal == "sv" else None
    )
    predicted = estimator.estimate(draft_probs, draft_ids, sources, companion_probs, do_sample)
    predicted = predicted.masked_fill(batch.finished[:, None], 0.0)  # the scheduler spends nothing on padding
    return draft_ids, sources, draft_probs, plan.choose(reads(predicted), proposal.drafted), predicted


def _caches(cache: Cache, proposer: Proposer) -> list[Cache]:
    return [cache, *proposer.caches()]


def cache_capacity(prompt_width: int, max_new_tokens: int, num_draft_tokens: int) -> int:
    """Columns the engine's caches hold: the prompt, the new tokens, one step of drafts, and as many columns again
    for holes (rejected drafts) before compaction must make room."""
    return prompt_width + 2 * (max_new_tokens + num_draft_tokens + 1)


def _retire_rows(batch: RaggedBatch, caches: list[Cache], proposer: Proposer, proposal: Proposal | None,
                 source_states: torch.Tensor | None) -> tuple[Proposal | None, torch.Tensor | None]:
    """Drops finished rows from the batch, the caches and the proposer's deferred work once that brings the batch
    down to a smaller `padded_batch_size` (`RaggedBatch.rows_to_keep`); returns the proposal and the source states
    `[B, d]` (None stays None) for the rows kept."""
    keep = batch.rows_to_keep()
    if keep is None:
        return proposal, source_states
    batch.select_rows(keep)
    proposer.select_rows(keep)
    for cache in caches:
        cache.batch_select_indices(keep)
    return (None if proposal is None else proposal.select_rows(keep),
            None if source_states is None else source_states[keep])


def _maybe_compact(batch: RaggedBatch, caches: list[PreallocatedCache], proposer: Proposer, hole_fraction: float,
                   room: int) -> None:
    """Gathers each row's valid cache columns to the left once the columns it would remove (holes that every row
    has, `RaggedBatch.removable_fraction`) reach `hole_fraction` of the columns, or when the next step's `room`
    columns would not fit. The proposer runs its deferred work first, so its cache has the target's columns."""
    if not batch.size:
        return
    full = batch.attention_mask.shape[1] + room > caches[0].capacity
    if full or batch.removable_fraction() >= hole_fraction:
        proposer.flush(batch)
        index = batch.compaction_index()
        for cache in caches:
            cache.gather_columns(index)
        batch.compact(index)


class CpuPatches:
    """The loop's CPU speed-ups (`FewRowLinears` over `modules`, `GroupedQueryAttention` of `model`), a context
    manager entered around each forward that gains from them and restored after it, also on exceptions; nothing
    when `enabled` is False or the model is not on the CPU."""

    def __init__(self, model, modules: list[torch.nn.Module], enabled: bool = True):
        self.patches = []
        if enabled and model.device.type == "cpu":
            self.patches = [FewRowLinears(modules, head=model.get_output_embeddings()), GroupedQueryAttention(model)]
        self.stack: list[contextlib.ExitStack] = []

    def __enter__(self) -> "CpuPatches":
        stack = contextlib.ExitStack()
        for patch in self.patches:
            stack.enter_context(patch)
        self.stack.append(stack)
        return self

    def __exit__(self, *exc_info) -> None:
        self.stack.pop().close()


def cpu_patches(model, modules: list[torch.nn.Module], enabled: bool = True) -> CpuPatches:
    """`CpuPatches(model, modules, enabled)`, for a `with` block."""
    return CpuPatches(model, modules, enabled)


def target_forward(model, input_ids, attention_mask, position_ids, cache, output_hidden_states, logits_to_keep):
    """One target forward of the loop: logits of the last `logits_to_keep` inputs (0: all), and the hidden states
    with `output_hidden_states`. Run it inside `cpu_patches` for the loop's speed on the CPU."""
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=output_hidden_states,
        logits_to_keep=logits_to_keep,
    )


def speculative_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    proposer: Proposer | None = None,
    speculative_streamer=None,
    compaction_hole_fraction: float = COMPACTION_HOLE_FRACTION,
    confidence_threshold: float = CONFIDENCE_THRESHOLD,
    schedule: str = "goodput",
    step_costs: StepCostModel | dict | str | None = None,
    companion=None,
    acceptance_table: dict | AcceptanceTable | None = None,
    cpu_speedups: bool = True,
    packed_verification: bool = True,
    cost_feedback: bool = True,
    **model_kwargs,
):
    """Batched lossless speculative decoding; a `generate` decoding method (see the module docstring).

    Args:
        model: the target causal LM.
        input_ids: `[B, P]` left-padded prompts (already expanded for `num_return_sequences`).
        logits_processor, stopping_criteria, generation_config: as prepared by `generate`.
        proposer: where drafts come from (`SpecFormerProposer`, `OracleProposer`, ...).
        speculative_streamer: a streamer (batch size 1 only); the prompt is put first.
        compaction_hole_fraction: compact the caches when the columns compaction would remove reach this share
            of their columns (> 1: never).
        confidence_threshold: with `schedule="fixed"`, a row verifies its drafts while their cumulative probability
            is at least this (`scheduling.py`; 0: all k).
        schedule: "goodput" (the goodput scheduler) or "fixed".
        step_costs: the goodput scheduler's `StepCostModel` (or its dict, or a saved file); default: measured on
            this machine once per model, dtype, device and drafter, and cached on disk (`scheduling.py`).
        companion: a bound `CompanionForVerification` (or any module called as `companion(hidden_states=[B, d],
            input_ids=[B, k])` returning `.logits` `[B, k, V]`): the goodput scheduler's signal becomes SV's (S, A).
        acceptance_table: the estimator's calibrated table (`AcceptanceTable` or its dict); default uncalibrated.
        cpu_speedups: on a CPU target, run the loop's forwards with `FewRowLinears` and `GroupedQueryAttention`
            (restored after the call, also on exceptions); False turns them off. Never applied on other devices.
        packed_verification: a step's linear layers compute only the inputs it verifies (`packing.py`), and the
            goodput scheduler picks (row, draft) pairs by their cost in inputs; False: padded steps of one width.
        cost_feedback: the goodput scheduler learns step costs from the call's timed steps and hands a losing call
            over to plain steps (`feedback.py`); False: the given or cached costs as they are.
        model_kwargs: `attention_mask` (`[B, P]` or None for no padding) and `past_key_values` (a `DynamicCache`).
    Returns:
        `[B, P + N]` sequences padded with `pad_token_id` after each row's end, or a `SpeculativeDecoderOnlyOutput`
        when `generation_config.return_dict_in_generate`.
    """
    if proposer is None:
        raise ValueError("Speculative decoding needs `proposer=`; use `hf_specformer.generate(assistant_model=...)`.")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {SCHEDULES}.")
    if schedule == "goodput" and confidence_threshold > 0:
        raise ValueError("confidence_threshold applies to schedule='fixed'; the goodput scheduler sets its own.")
    if companion is not None and schedule != "goodput":
        raise ValueError("A companion model only serves the goodput scheduler (schedule='goodput').")
    modules = [model, *proposer.modules(), *([companion] if companion is not None else [])]
    patches = CpuPatches(model, modules, cpu_speedups)
    if proposer.num_draft_tokens == 0:
        return _plain_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, proposer,
                             speculative_streamer, model_kwargs)
    estimator = _make_estimator(acceptance_table, companion, proposer.num_draft_tokens) \
        if schedule == "goodput" else None
    expected = estimator.table.expected_accepted if estimator is not None else None
    profile = _step_cost_profile(model, proposer, bool(patches.patches), input_ids.shape[0], step_costs)
    plan = _make_schedule(schedule, proposer.num_draft_tokens, confidence_threshold, profile, expected,
                          packed_verification, cost_feedback)
    if not plan.speculation_pays(input_ids.shape[0]):
        return _plain_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, proposer,
                             speculative_streamer, model_kwargs)
    output = _decode(
        model, input_ids, logits_processor, stopping_criteria, generation_config, proposer, speculative_streamer,
        compaction_hole_fraction, plan, estimator, companion, packed_verification, patches, profile, model_kwargs,
    )
    if step_costs is None:
        _remember_costs(plan, model, proposer, bool(patches.patches), input_ids.shape[0])
    return output


def _plain_decode(
    model, input_ids, logits_processor, stopping_criteria, generation_config, proposer, streamer, model_kwargs
):
    """transformers' own decoding loop (`GenerationMixin._sample`), untouched by this package's CPU patches: what
    a call runs with k = 0, or when the goodput scheduler predicts that no width pays at its batch size."""
    stats = proposer.stats = SpecStats(num_draft_tokens=proposer.num_draft_tokens, plain_decoding=True)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    output = GenerationMixin._sample(
        model, input_ids, logits_processor, stopping_criteria, generation_config, streamer=streamer, **model_kwargs
    )
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    stats.steps = stats.width_counts[0] = sequences.shape[1] - input_ids.shape[1]
    stats.row_steps = stats.steps * input_ids.shape[0]
    if generation_config.return_dict_in_generate:
        return SpeculativeDecoderOnlyOutput(sequences=sequences, speculation_stats=stats)
    return sequences


def _decode(
    model, input_ids, logits_processor, stopping_criteria, generation_config, proposer, speculative_streamer,
    compaction_hole_fraction, plan, estimator, companion, packed_verification, patches, profile, model_kwargs,
):
    """The body of `speculative_decode`: prefill, then verification steps until every row has finished. A step that
    verifies nothing runs `transformers`' own forward (no CPU patches) and the proposer defers its work, so it costs
    what a plain decoding step does; every step is timed for the schedule (`feedback.py`)."""
    given = model_kwargs.get("past_key_values")
    if not isinstance(given, DynamicCache) or given.get_seq_length() > 0:
        raise ValueError("Speculative generation needs a fresh `DynamicCache` (static/offloaded caches not supported).")
    do_sample = bool(generation_config.do_sample)
    k = proposer.num_draft_tokens
    needs_hidden_states = proposer.requires_hidden_states or companion is not None
    max_new_tokens = generation_config.max_length - input_ids.shape[1]
    capacity = cache_capacity(input_ids.shape[1], max_new_tokens, k)
    cache = PreallocatedCache.like(given, model.config.get_text_config().num_hidden_layers, capacity)
    batch = RaggedBatch.start(
        input_ids, model_kwargs.get("attention_mask"), max_new_tokens + k + 1, _pad_token_id(generation_config)
    )
    processor = RaggedLogitsProcessor(logits_processor)
    commit = _Committer(stopping_criteria, generation_config, max_new_tokens, speculative_streamer)
    stats = proposer.stats = SpecStats(num_draft_tokens=k)
    proposer.start(capacity)
    caches = _caches(cache, proposer)
    packed_linears = PackedLinears(model)
    clock = StepClock(input_ids.device)
    reads = HostReads()
    if speculative_streamer is not None:
        speculative_streamer.put(input_ids.cpu())

    # Prefill: the prompt through the target; its last position gives the first token, the proposer the first drafts.
    position_ids = batch.prompt_position_ids()
    with patches:
        output = target_forward(
            model, input_ids, batch.attention_mask, position_ids, cache, needs_hidden_states, logits_to_keep=1
        )
    batch.commit_prompt()
    first = _select_tokens(processor(batch, output.logits[:, -1:])[:, 0], do_sample)
    batch.finished = commit(batch, first[:, None], torch.ones_like(first))
    source_index = torch.full_like(first, input_ids.shape[1] - 1)
    proposal = _propose(plan, proposer, patches, batch, output, position_ids, source_index)
    source_states = _source_states(output, source_index) if companion is not None else None
    batch.refresh(reads)
    proposal, source_states = _retire_rows(batch, caches, proposer, proposal, source_states)

    while batch.size > 0:
        _observe(clock, plan, stats, profile)
        proposed = proposal is not None  # False: a plain step by the schedule's word (nothing proposed)
        stats.drafting_steps += proposed and proposal.drafted
        last_committed = batch.tokens[batch.row_ids, batch.prefix_lengths() - 1]
        draft_ids, sources, draft_probs, counts, predicted = _plan_step(
            batch, processor, proposal, do_sample, plan, estimator, companion, source_states, last_committed, reads
        )
        if proposed and proposal.ids is not None:
            stats.record_lookups(sources == LOOKUP, input_ids.shape[0])
        width = max(counts.tolist())  # drafts fed per row this step (counts are on the host)
        num_drafts = counts.to(last_committed.device, non_blocking=True).masked_fill(batch.finished, 0)
        plan.stepped(proposed)
        draft_ids = draft_ids[:, :width]
        step_ids = torch.cat([last_committed[:, None], draft_ids], dim=1)  # [B, width + 1]
        attention_mask, position_ids = batch.step_inputs(width + 1)
        if width:
            verified = torch.arange(width + 1) <= counts[:, None]  # [B, width + 1], on the host
            with patches, packed_linears.select(verified, packed_verification):
                output = target_forward(
                    model, step_ids, attention_mask, position_ids, cache, needs_hidden_states, logits_to_keep=0
                )
        else:
            output = target_forward(model, step_ids, attention_mask, position_ids, cache, needs_hidden_states, 0)
        target_scores = processor(batch, output.logits)  # [B, width + 1, V]; drafts already in the scratch space
        if do_sample:
            target_probs = target_scores.softmax(-1)
            draft_distributions = _draft_distributions(draft_ids, sources, draft_probs, target_probs.shape[-1])
            tokens, num_accepted = verify_sampling(draft_ids, draft_distributions, target_probs, num_drafts)
        else:
            tokens, num_accepted = verify_greedy(draft_ids, target_scores, num_drafts)
        if estimator is not None and predicted is not None:
            estimator.observe(num_accepted, num_drafts)
        live = ~batch.finished
        stats.record(batch.row_ids, num_accepted, input_ids.shape[0], num_drafts, predicted, live)
        batch.commit_cache((num_accepted + 1) * live, width + 1)
        batch.finished = commit(batch, tokens, num_accepted + 1)
        step_size = batch.size
        clock.mark()
        proposal = _propose(plan, proposer, patches, batch, output, position_ids, num_accepted)
        source_states = _source_states(output, num_accepted) if companion is not None else None
        step_counts = batch.refresh(reads, num_drafts.sum(), num_accepted.sum(), live.sum())
        proposal, source_states = _retire_rows(batch, caches, proposer, proposal, source_states)
        _maybe_compact(batch, caches, proposer, compaction_hole_fraction, k + 1)
        clock.lap(("step", step_size, width, step_counts, proposed, None if proposal is None else proposal.drafted))

    _observe(clock, plan, stats, profile)
    stats.handoffs = plan.handoff.handoffs if isinstance(plan, GoodputSchedule) else 0
    stats.host_reads = reads.count
    stats.finish()
    if speculative_streamer is not None:
        speculative_streamer.end()
    sequences = batch.sequences()
    if generation_config.return_dict_in_generate:
        return SpeculativeDecoderOnlyOutput(sequences=sequences, speculation_stats=stats)
    return sequences


def _propose(plan, proposer: Proposer, patches, batch: RaggedBatch, output, position_ids,
             source_index) -> Proposal | None:
    """The proposer's work after a target forward, as the schedule wants it for the next step: its proposal (the
    network drafting or not, `should_draft`), or None when the next step is plain (nothing proposed, `skip`)."""
    if plan.plain_step_due():
        proposer.skip(batch, output.hidden_states, position_ids, source_index)
        return None
    drafting = plan.should_draft(batch.size)  # rows finishing now included: a cost estimate, not worth a sync
    with patches if drafting else contextlib.nullcontext():
        return proposer.propose(batch, output.hidden_states, position_ids, source_index, draft=drafting)


def _observe(clock: StepClock, plan, stats: SpecStats, profile: StepCostModel | None) -> None:
    """Hands the steps timed so far to the schedule and the statistics; the clock then times the next step."""
    steps = clock.read()
    plan.observe(steps)
    stats.record_seconds(steps, profile)
    clock.restart()
