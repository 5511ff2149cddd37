"""`hf-specformer bench`: speculative against plain `generate`, same prompts, same machine, one interleaved run.

    hf-specformer bench --batch-sizes 1 4 8 16 32 64 --output bench/smollm2_cpu        # SmolLM2 + the shipped drafter
    hf-specformer bench --host-overhead --output bench/host_overhead                     # the loop's own cost

Every batch of B prompts runs each call in turn (every second round reversed), against plain `generate` and, on the
CPU, plain `generate` under `cpu_products`: seconds, tokens/s, speedups, kappa, and rows that differ (a tie or a bug,
`ties.py`). `--host-overhead` times the loop on a tiny random Llama, where a step is nearly all host time, as a
GPU's small-batch step is, split into the target's forward, drafting and the rest. Writes `<output>.json` and `.png`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..attention import GQA_SDPA
from ..cpu import cpu_products
from ..data.prompts import bench_prompts, chat_batches
from ..generation import OracleProposer, Proposal, Proposer, generate
from ..targets import (DEFAULT_TARGET, DTYPES, default_device, describe_machine, load_drafter, load_target,
                       load_tokenizer, timed)
from .ties import classify_rows


@dataclass
class BenchConfig:
    """What `hf-specformer bench` measures (see the module docstring)."""

    target: str = DEFAULT_TARGET
    drafter: str | None = None  # a drafter folder; None: the shipped one
    prompts: list[str] = field(default_factory=lambda: ["mixed"])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8, 16, 32, 64])
    schedules: list[str] = field(default_factory=lambda: ["goodput"])
    oracle: bool = False
    max_new_tokens: int = 128
    min_rows: int = 16
    rounds: int = 2
    dtype: str = "float32"
    device: str | None = None
    threads: int | None = None
    output: str = "bench/smollm2_cpu"


def count_new_tokens(sequences: torch.LongTensor, prompt_width: int, eos_token_id: int) -> int:
    """New tokens per row up to and including the first EOS."""
    new = sequences[:, prompt_width:]
    is_eos = new == eos_token_id
    lengths = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, torch.full_like(new[:, 0], new.shape[1]))
    return int(lengths.sum())


def _calls(target, drafter, config: BenchConfig) -> dict:
    """Name -> call(batch, reference, generate arguments) -> sequences or output, for one batch size."""
    cpu = target.device.type == "cpu"
    backend = (lambda: cpu_products(target, drafter)) if cpu else contextlib.nullcontext

    def ours(schedule: str):
        def call(batch, reference, kwargs):
            with backend():
                return generate(target, **batch, assistant_model=drafter, return_dict_in_generate=True, **kwargs,
                                speculation_config={"schedule": schedule})
        return call

    def oracle(batch, reference, kwargs):
        proposer = OracleProposer(reference[:, batch["input_ids"].shape[1]:], drafter.config.num_speculative_tokens,
                                  target.config.vocab_size, kwargs["pad_token_id"])
        with backend():
            return generate(target, **batch, assistant_model=proposer, return_dict_in_generate=True, **kwargs,
                            speculation_config={"schedule": "fixed", "lookup_ngram_size": 0})

    calls = {"plain": lambda batch, reference, kwargs: target.generate(**batch, **kwargs)}
    if cpu:
        def plain_cpu(batch, reference, kwargs):
            with cpu_products(target):
                return target.generate(**batch, **kwargs)
        calls["plain+cpu"] = plain_cpu
    calls.update({f"ours [{schedule}]": ours(schedule) for schedule in config.schedules})
    if config.oracle:
        calls["oracle [fixed]"] = oracle
    return calls


def bench_batch_size(target, tokenizer, drafter, prompts: list[str], batch_size: int, config: BenchConfig,
                     extra_calls: dict | None = None):
    """Every call (and `extra_calls`, named as `_calls` names them) at one batch size, interleaved batch by batch;
    one result row per call."""
    batches = [b.to(target.device) for b in chat_batches(tokenizer, prompts[: max(batch_size, config.min_rows)],
                                                        batch_size)]
    kwargs = dict(max_new_tokens=config.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    calls = {**_calls(target, drafter, config), **(extra_calls or {})}
    seconds = {name: 0.0 for name in calls}
    stats = {name: [] for name in calls}
    mismatches = {name: [] for name in calls}
    references, tokens = [None] * len(batches), 0
    target.generate(**batches[0], **{**kwargs, "max_new_tokens": 4})  # warm-up
    for round_index in range(config.rounds):
        for index, batch in enumerate(tqdm(batches, desc=f"B={batch_size} round {round_index + 1}", leave=False)):
            order = list(calls) if round_index % 2 == 0 else ["plain", *reversed(list(calls)[1:])]
            for name in order:
                output, spent = timed(lambda: calls[name](batch, references[index], kwargs), target.device)
                sequences = output if isinstance(output, torch.Tensor) else output.sequences
                seconds[name] += spent
                if name == "plain" and references[index] is None:
                    references[index] = sequences
                    tokens += count_new_tokens(sequences, batch["input_ids"].shape[1], tokenizer.eos_token_id)
                if not isinstance(output, torch.Tensor):
                    stats[name].append(output.speculation_stats.to_dict())
                mismatches[name] += [m.to_dict() for m in classify_rows(
                    target, batch["input_ids"], batch["attention_mask"], references[index], sequences,
                    tokenizer.pad_token_id)]
    tokens *= config.rounds
    rows = []
    for name in calls:
        row = {"call": name, "batch_size": batch_size, "batches": len(batches), "rounds": config.rounds,
               "rows": len(batches) * batch_size * config.rounds, "new_tokens": tokens, "seconds": seconds[name],
               "tokens_per_s": tokens / seconds[name], "speedup": seconds["plain"] / seconds[name],
               "mismatched_rows": len(mismatches[name]), "true_bug_rows": sum(not m["tie"] for m in mismatches[name]),
               "mismatches": mismatches[name]}
        if "plain+cpu" in seconds:
            row["speedup_over_plain_cpu"] = seconds["plain+cpu"] / seconds[name]
        if stats[name]:
            calls_stats = stats[name]
            row_steps = sum(s["row_steps"] for s in calls_stats)
            row.update(kappa=(row_steps + sum(s["accepted"] for s in calls_stats)) / max(row_steps, 1),
                       width_counts=[sum(w) for w in zip(*(s["width_counts"] for s in calls_stats))],
                       handoffs=sum(s["handoffs"] for s in calls_stats),
                       host_reads_per_step=sum(s["host_reads"] for s in calls_stats) /
                       max(sum(s["steps"] for s in calls_stats), 1))
        rows.append(row)
    return rows


# ----- the host's cost per step ---------------------------------------------------------------------------------
class ProposesNothing(Proposer):
    """A proposer of k drafts that never proposes one: every step of the engine is a plain step."""

    def propose(self, batch, step, caches, draft=True, free=True) -> Proposal:
        return Proposal()


class PhaseTimer:
    """Seconds inside the target's forwards and inside proposing, over a call (forward hooks, `time.perf_counter`)."""

    def __init__(self, target, proposer: Proposer | None):
        self.forward = self.proposing = self.started = 0.0
        self.forwards, self.proposer = 0, proposer
        self.handles = [target.register_forward_pre_hook(lambda *a: setattr(self, "started", time.perf_counter())),
                        target.register_forward_hook(self._stop)]
        if proposer is not None:
            propose = proposer.propose

            def timed_propose(*args, **kwargs):
                start = time.perf_counter()
                result = propose(*args, **kwargs)
                self.proposing += time.perf_counter() - start
                return result
            proposer.propose = timed_propose

    def _stop(self, *args):
        self.forward += time.perf_counter() - self.started
        self.forwards += 1

    def close(self):
        for handle in self.handles:
            handle.remove()
        if self.proposer is not None:
            del self.proposer.propose


def tiny_target(seed: int = 0):
    """The host-overhead model: a random Llama of 4 layers, hidden 64, vocabulary 1,024, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def host_overhead(batch_sizes: list[int], new_tokens: int = 64, prompt_length: int = 32, repeats: int = 15) -> list:
    """Per batch size: plain `generate`, perfect drafts (k = 3, also under `GQA_SDPA`), no drafts and k = 0, in
    shuffled orders `repeats` times; medians of seconds and of each phase's time per target forward."""
    torch.set_num_threads(1)
    target, grouped = tiny_target(), tiny_target()
    grouped.set_attn_implementation(GQA_SDPA)
    rows = []
    for batch_size in batch_sizes:
        ids = torch.randint(3, 1000, (batch_size, prompt_length), generator=torch.Generator().manual_seed(batch_size))
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False)
        reference = target.generate(**kwargs)
        oracle, nothing = OracleProposer(reference[:, prompt_length:], 3, 1024, 0), ProposesNothing(3)
        fixed = {"schedule": "fixed", "lookup_ngram_size": 0}
        calls = {
            "plain generate": (lambda: target.generate(**kwargs), target, None),
            "perfect drafts, k = 3": (lambda: generate(target, assistant_model=oracle, **kwargs,
                                                       speculation_config=fixed), target, oracle),
            "perfect drafts, k = 3, GQA_SDPA": (lambda: generate(grouped, assistant_model=oracle, **kwargs,
                                                                  speculation_config=fixed), grouped, oracle),
            "engine, no drafts": (lambda: generate(target, assistant_model=nothing, **kwargs,
                                                   speculation_config=fixed), target, None),
            "k = 0": (lambda: generate(target, assistant_model=oracle, num_assistant_tokens=0, **kwargs), target,
                      None),
        }
        measured, order = {name: [] for name in calls}, list(calls)
        for repeat in range(repeats):
            random.Random(repeat).shuffle(order)  # a new order each time: no call always follows the same one
            for name in order:
                call, model, proposer = calls[name]
                timer = PhaseTimer(model, proposer)
                try:
                    output, seconds = timed(call, "cpu")
                finally:
                    timer.close()
                if not torch.equal(output, reference):
                    raise AssertionError(f"{name} at B = {batch_size} differs from plain generate")
                measured[name].append((seconds, timer.forward, timer.proposing, timer.forwards))
        plain = statistics.median(m[0] for m in measured["plain generate"])
        for name, runs in measured.items():
            seconds = statistics.median(r[0] for r in runs)
            forwards = runs[0][3]
            forward, proposing = statistics.median(r[1] for r in runs), statistics.median(r[2] for r in runs)
            rows.append({"call": name, "batch_size": batch_size, "seconds": seconds, "speedup": plain / seconds,
                         "forwards": forwards, "ms_per_forward": 1000 * seconds / forwards,
                         "ms_target_forward": 1000 * forward / forwards, "ms_drafting": 1000 * proposing / forwards,
                         "ms_rest": 1000 * (seconds - forward - proposing) / forwards})
    return rows


def plot(rows: list[dict], path: Path, host: bool) -> None:
    """Speedup per batch size for each call (benchmark), or each call's time per forward split by phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    calls = list(dict.fromkeys(row["call"] for row in rows))
    if host:
        sizes = sorted({row["batch_size"] for row in rows})
        labels, bottoms = [], []
        for size in sizes:
            for call in calls:
                row = next(r for r in rows if r["call"] == call and r["batch_size"] == size)
                name = call.replace(", ", "\n")
                labels.append(f"B={size}\n{name}\n{row['speedup']:.2f}x")
                bottoms.append(row)
        base = [0.0] * len(bottoms)
        for phase, colour in (("ms_target_forward", "tab:blue"), ("ms_drafting", "tab:orange"), ("ms_rest", "grey")):
            heights = [r[phase] for r in bottoms]
            axis.bar(range(len(bottoms)), heights, bottom=base, color=colour, label=phase[3:].replace("_", " "))
            base = [b + h for b, h in zip(base, heights)]
        axis.set_xticks(range(len(labels)), labels, fontsize=6)
        axis.set_ylabel("ms per target forward")
        axis.set_title("Host cost per step: tiny Llama, fp32, one thread")
    else:
        for call in calls:
            picked = [r for r in rows if r["call"] == call]
            axis.plot([r["batch_size"] for r in picked], [r["speedup"] for r in picked], marker="o", label=call)
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("batch size")
        axis.set_ylabel("speedup over plain generate")
        axis.set_title("Speculative vs plain greedy generate (one interleaved run)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_benchmark(config: BenchConfig) -> dict:
    """Every batch size and call; writes `<output>.json` and `<output>.png`; returns the report."""
    if config.threads:
        torch.set_num_threads(config.threads)
    target = load_target(config.target, dtype=DTYPES[config.dtype], device=config.device or default_device())
    tokenizer = load_tokenizer(config.target)
    drafter = load_drafter(config.drafter, target)
    prompts = bench_prompts(config.prompts)
    if len(prompts) < max(config.batch_sizes):
        raise SystemExit(f"The largest batch size, {max(config.batch_sizes)}, needs as many prompts; {config.prompts}"
                         f" gave {len(prompts)}.")
    rows = []
    for batch_size in tqdm(config.batch_sizes, desc="batch sizes"):
        rows += bench_batch_size(target, tokenizer, drafter, prompts, batch_size, config)
        for row in rows[-len(_calls(target, drafter, config)):]:
            tqdm.write(f"B={batch_size} {row['call']}: {row['speedup']:.2f}x, {row['tokens_per_s']:.1f} tok/s, "
                       f"kappa {row.get('kappa', 1.0):.2f}, {row['mismatched_rows']} rows differ")
    return _write({"config": asdict(config), "machine": describe_machine(target.device, config.dtype),
                   "results": rows}, config.output, host=False)


def _write(report: dict, output: str, host: bool) -> dict:
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(report, indent=2, allow_nan=False))
    plot(report["results"], path.with_suffix(".png"), host)
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-specformer bench", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped one)")
    parser.add_argument("--prompts", nargs="+", default=["mixed"],
                        help="mtbench, passages, chat, mixed, or prompt files (default: mixed)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--schedules", nargs="+", choices=["goodput", "fixed"], default=["goodput"])
    parser.add_argument("--oracle", action="store_true", help="also perfect drafts (the engine's ceiling)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--min-rows", type=int, default=16, help="rows generated per batch size (at least B)")
    parser.add_argument("--rounds", type=int, default=2, help="times every batch runs (order reversed each second)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--host-overhead", action="store_true", help="the loop's own cost on a tiny random Llama")
    parser.add_argument("--output", required=True, help="path stem of the JSON and PNG")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.host_overhead:
        sizes = args.batch_sizes if args.batch_sizes != build_parser().get_default("batch_sizes") else [1, 32]
        return _write({"machine": describe_machine("cpu", "float32"), "results": host_overhead(sizes)}, args.output,
                      host=True)
    fields = {name: value for name, value in vars(args).items() if name != "host_overhead"}
    return run_benchmark(BenchConfig(**fields))
