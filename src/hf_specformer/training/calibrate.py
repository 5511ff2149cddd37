"""Calibrate acceptance estimators on held-out self-distilled data, compare them, and store their tables.

    hf-specformer calibrate --data D --drafter DIR [--companion DIR] [--write] [--output report.json]

Teacher-forced on the target's own greedy answers: at every reply position the drafter drafts k tokens and the
answer says which would be accepted (a label counts after accepted drafts only). Signals: the drafter's confidence,
or the companion's (S, A). Fitted on one half of the sequences and scored on the other (AUC, Brier score, information
gain in bits over the base rate). `--write` stores the tables in the drafter's and companion's `config.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModel

from hf_specformer.generation.acceptance import (DRAFTER, AcceptanceTable, draft_confidence, sv_features)
from hf_specformer.targets import load_data_target
from hf_specformer.training.data import load_distilled
from hf_specformer.training.target_states import next_token_ids, reply_positions, target_hidden_states, tokens_after

logger = logging.getLogger(__name__)


@torch.no_grad()
def draft_records(target, drafter, companion, dataset, num_draft_tokens: int, max_length: int = 512,
                  progress: bool = True) -> dict[str, torch.Tensor]:
    """Signals and labels of every (reply position, slot) of `dataset`, flattened to `[N, k]` tensors:
    confidence, S, A (without a companion: NaN), accepted, observed, and `sequence` `[N]`."""
    k = num_draft_tokens
    columns: dict[str, list[torch.Tensor]] = {name: [] for name in
                                              ("confidence", "S", "A", "accepted", "observed", "sequence")}
    for index, row in enumerate(tqdm(dataset, desc="calibration data", disable=not progress, leave=False)):
        ids = torch.tensor(row["input_ids"][:max_length], device=target.device)
        positions = reply_positions(ids, row["prompt_length"])
        if positions.numel() == 0:
            continue
        hidden = target_hidden_states(target, ids[None], torch.ones_like(ids)[None])
        output = drafter(drafter.select_hooked_states(hidden), draft_positions=positions[None], num_draft_tokens=k,
                         next_token_ids=next_token_ids(ids[None]), use_cache=False)
        logits = output.logits[0].float()  # [P, k, V]
        probs = logits.softmax(-1)
        drafts = probs.argmax(-1)  # greedy drafts [P, k]
        truth = tokens_after(ids, positions, 2, k)  # [P, k]: what drafts 1..k should be
        match = (drafts == truth) & (truth >= 0)
        previous = torch.cat([torch.ones_like(match[:, :1]), match[:, :-1]], dim=1).cumprod(1).bool()
        columns["confidence"].append(draft_confidence(probs, drafts).cpu())
        if companion is not None:
            chain = torch.cat([ids[positions + 1][:, None], drafts[:, :-1]], dim=1)
            companion_probs = companion(hidden_states=hidden[-1][0, positions], input_ids=chain).logits.float()
            signals = sv_features(probs, companion_probs.softmax(-1), drafts).cpu()
        else:
            signals = torch.full((*drafts.shape, 2), float("nan"))
        columns["S"].append(signals[..., 0])
        columns["A"].append(signals[..., 1])
        columns["accepted"].append(match.cpu())
        columns["observed"].append((previous & (truth >= 0)).cpu())
        columns["sequence"].append(torch.full((positions.numel(),), index))
    return {name: torch.cat(values) for name, values in columns.items()}


def _flat(records: dict, rows: torch.Tensor, features: list[str]):
    """Observed drafts of `rows`: features `[M, F]`, sources, slots, labels `[M]`."""
    observed = records["observed"][rows]
    slots = torch.arange(observed.shape[1]).expand_as(observed)[observed]
    values = torch.stack([records[name][rows][observed] for name in features], dim=-1)
    labels = records["accepted"][rows][observed].float()
    return values, torch.full_like(slots, DRAFTER), slots, labels


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """Area under the ROC curve (ties count half), by ranks; None without both labels."""
    positives = labels.bool()
    num_pos, num_neg = int(positives.sum()), int((~positives).sum())
    if num_pos == 0 or num_neg == 0:
        return None
    sorted_scores, order = scores.double().sort()
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    mean_rank = counts.cumsum(0).double() - (counts.double() - 1) / 2  # tied scores share their mean rank
    ranks = torch.empty(len(scores), dtype=torch.float64)
    ranks[order] = mean_rank[inverse]
    return float((ranks[positives].sum() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))


def binary_entropy_bits(p: torch.Tensor) -> torch.Tensor:
    p = p.double().clamp(1e-6, 1 - 1e-6)
    return -(p * torch.log2(p) + (1 - p) * torch.log2(1 - p))


def scores(estimates: torch.Tensor, labels: torch.Tensor, base_rate: float) -> dict:
    """AUC, Brier score and held-out information gain (bits per draft) of `estimates` for binary `labels`."""
    p = estimates.double().clamp(1e-4, 1 - 1e-4)
    y = labels.double()
    log_loss_bits = -(y * torch.log2(p) + (1 - y) * torch.log2(1 - p)).mean()
    entropy = binary_entropy_bits(torch.tensor(base_rate))
    return {
        "auc": auc(estimates, labels),
        "brier": float(((p - y) ** 2).mean()),
        "information_gain_bits": float(entropy - log_loss_bits),
        "entropy_bits": float(entropy),
    }


def quantile_edges(values: torch.Tensor, num_bins: int) -> list[float]:
    """Interior edges of about equal-mass bins of `values` `[N]`; repeated edges dropped."""
    quantiles = torch.linspace(0, 1, num_bins + 1, dtype=torch.float64)[1:-1]
    edges = torch.quantile(values.double(), quantiles).unique()
    return [float(edge) for edge in edges if 0.0 < edge < 1.0]


def fit_table(signal: str, features, sources, slots, accepted, num_bins: int = 10,
              num_slots: int | None = None) -> AcceptanceTable:
    """An `AcceptanceTable` of `signal` fitted on drafts (`features` `[N, F]`, `accepted` `[N]`): equal-mass bins,
    each cell's counts, and E_w."""
    num_slots = num_slots or int(slots.max()) + 1
    drafter = sources == DRAFTER
    edges = [quantile_edges(features[drafter, f], num_bins) for f in range(features.shape[1])]
    per_slot = torch.bincount(slots[drafter], weights=accepted[drafter].double(), minlength=num_slots)
    positions = max(int((slots[drafter] == 0).sum()), 1)
    expected = [0.0] + (per_slot[:num_slots].cumsum(0) / positions).tolist()
    table = AcceptanceTable(signal, edges, num_slots, expected_accepted=expected)
    table.add(features, sources, slots, accepted)
    return table


def compare_estimators(records: dict, num_slots: int, seed: int = 0) -> dict:
    """Fits (a) and (c) on half the sequences and scores them on the other half (see the module docstring)."""
    sequences = records["sequence"].unique()
    permutation = sequences[torch.randperm(len(sequences), generator=torch.Generator().manual_seed(seed))]
    fit_ids = permutation[: len(permutation) // 2]
    fit_rows = torch.isin(records["sequence"], fit_ids)
    evaluation_rows = ~fit_rows
    report = {"fit_drafts": int(records["observed"][fit_rows].sum()),
              "evaluation_drafts": int(records["observed"][evaluation_rows].sum())}
    conf_fit, sources, slots, labels = _flat(records, fit_rows, ["confidence"])
    conf_eval, sources_eval, slots_eval, labels_eval = _flat(records, evaluation_rows, ["confidence"])
    base_rate = float(labels.mean())
    report["base_rate"] = base_rate
    report["evaluation_acceptance"] = float(labels_eval.mean())

    table = fit_table("confidence", conf_fit, sources, slots, labels, num_slots=num_slots)
    report["confidence_table"] = scores(table.estimate(conf_eval, sources_eval, slots_eval), labels_eval, base_rate)
    report["raw_confidence"] = scores(conf_eval[:, 0], labels_eval, base_rate)

    if not torch.isnan(records["S"]).all():
        sa_fit = _flat(records, fit_rows, ["S", "A"])[0]
        sa_eval = _flat(records, evaluation_rows, ["S", "A"])[0]
        sv_table = fit_table("sv", sa_fit, sources, slots, labels, num_slots=num_slots)
        report["sv_table"] = scores(sv_table.estimate(sa_eval, sources_eval, slots_eval), labels_eval, base_rate)
    return report


def fit_tables(records: dict, num_slots: int) -> dict[str, AcceptanceTable]:
    """(a)'s and, with companion signals, (c)'s tables fitted on all the records."""
    everything = torch.ones_like(records["sequence"], dtype=torch.bool)
    confidence, sources, slots, labels = _flat(records, everything, ["confidence"])
    tables = {"confidence": fit_table("confidence", confidence, sources, slots, labels, num_slots=num_slots)}
    if not torch.isnan(records["S"]).all():
        signals = _flat(records, everything, ["S", "A"])[0]
        tables["sv"] = fit_table("sv", signals, sources, slots, labels, num_slots=num_slots)
    return tables


def write_table(folder: str | Path, table: AcceptanceTable) -> None:
    """Stores `table` as `acceptance_table` in `folder/config.json`."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    config["acceptance_table"] = table.to_dict()
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def calibrate(args: argparse.Namespace) -> dict:
    """Runs the calibration described in the module docstring; returns the report."""
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_data_target(args.data, args.target)
    drafter = AutoModel.from_pretrained(args.drafter, trust_remote_code=True, dtype=target.dtype).eval()
    drafter.bind_target(target)
    companion = None
    if args.companion:
        companion = AutoModel.from_pretrained(args.companion, trust_remote_code=True, dtype=target.dtype).eval()
        companion.bind_target(target)
    k = args.num_draft_tokens or drafter.config.num_speculative_tokens
    dataset = load_distilled(args.data)
    if args.limit:
        dataset = dataset.select(range(min(args.limit, len(dataset))))
    records = draft_records(target, drafter, companion, dataset, k, args.max_length)
    report = {"data": args.data, "sequences": len(dataset), "num_draft_tokens": k,
              **compare_estimators(records, k, args.seed)}
    if args.write:
        tables = fit_tables(records, k)
        write_table(args.drafter, tables["confidence"])
        if companion is not None:
            write_table(args.companion, tables["sv"])
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2, allow_nan=False))
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hf-specformer calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="held-out distilled data (a distill output folder)")
    parser.add_argument("--drafter", required=True, help="the drafter folder")
    parser.add_argument("--companion", default=None, help="a companion folder (adds SV's (S, A) estimator)")
    parser.add_argument("--target", default=None, help="default: the one the data was distilled from")
    parser.add_argument("--num-draft-tokens", "-k", type=int, default=None, help="default: the drafter's")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N sequences")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fit/evaluation split")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--write", action="store_true", help="store the fitted tables in the model folders")
    parser.add_argument("--output", default=None, help="report JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    report = calibrate(args)
    figures = "; ".join(f"{name}: AUC {'n/a' if scored['auc'] is None else format(scored['auc'], '.3f')}, "
                        f"{scored['information_gain_bits']:.3f} bits" for name, scored in report.items()
                        if name in ("confidence_table", "sv_table"))
    print(f"calibrated on {report['sequences']} sequences at k = {report['num_draft_tokens']} (acceptance "
          f"{report['evaluation_acceptance']:.2f}): {figures}" + ("; tables written" if args.write else "") +
          (f"; report {args.output}" if args.output else ""))
    return report


if __name__ == "__main__":
    main()
