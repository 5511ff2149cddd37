"""Command line: dispatch, argument errors, and `export` producing a complete Hub folder with a card."""

from __future__ import annotations

import json
import os

import pytest
from conftest import CHAT_PROMPTS, make_drafter, make_target, tiny_chat_target

from hf_specformer.apps import cli
from hf_specformer.apps.bench import build_parser


def test_no_command_prints_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    assert "hf-specformer demo" in capsys.readouterr().out


COMMAND_OPTIONS = {
    "demo": "--slots", "generate": "--plain", "synthesize": "--num-prompts", "distill": "--prompts",
    "train": "--soft-label-weight", "train-companion": "--output", "calibrate": "--write", "bench": "--oracle",
    "eval-drafter": "--with-lookup", "export": "--draft-vocab-size", "export-companion": "--calibration",
}
"""Every command and an option only its own parser has."""


def test_every_command_is_listed_and_has_its_own_help(capsys):
    """Each command dispatches to its own parser: its usage line names it and shows its own option."""
    assert all(f"hf-specformer {command}" in cli.__doc__ for command in COMMAND_OPTIONS)
    for command, option in COMMAND_OPTIONS.items():
        with pytest.raises(SystemExit) as exit_info:
            cli.main([command, "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: hf-specformer {command} ") and option in out, (command, out[:200])


def test_export_writes_hub_folder_with_card(tmp_path):
    drafter = make_drafter(make_target("llama"))
    drafter.save_pretrained(tmp_path / "trained")
    (tmp_path / "eval.json").write_text(json.dumps({"kappa": [1.5, 1.8], "slot_accuracy": [0.5, 0.3]}))
    cli.main(["export", "--drafter", str(tmp_path / "trained"), "--output", str(tmp_path / "hub"),
              "--eval", str(tmp_path / "eval.json")])
    folder = tmp_path / "hub"
    assert (folder / "custom_generate" / "generate.py").exists()
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    card = (folder / "README.md").read_text()
    assert "speculative-decoding" in card and "| 2 | 1.800 |" in card and "# hub\n" in card
    assert "base_model:" not in card  # a tiny random target has no Hub id (see test_hub for the cases)
    assert f"parameters: {drafter.num_parameters() / 1e6:.2f}M" in card


def test_card_reports_the_benchmarks_speculative_call_against_both_baselines(tmp_path):
    from hf_specformer.hub.cards import render_card

    def row(call, batch_size, speedup, **extra):
        return {"call": call, "batch_size": batch_size, "rows": 16, "mismatched_rows": 0, "tokens_per_s": 10 * speedup,
                "speedup": speedup, "speedup_over_plain_cpu": speedup / 1.2, **extra}

    report = {"machine": {"platform": "p", "cpu": "c", "torch": "t", "threads": 2},
              "config": {"max_new_tokens": 128, "prompts": ["mtbench"]},
              "results": [row("plain", 1, 1.0), row("ours [goodput]", 1, 2.4, kappa=1.9),
                          row("ours [goodput]", 8, 1.2, kappa=1.1)]}
    (tmp_path / "bench.json").write_text(json.dumps(report))
    card = render_card(make_drafter(make_target("llama")), bench_path=str(tmp_path / "bench.json"))
    assert "| 1 | 24.0 | 2.40x | 2.00x | 1.90 | 16/16 |" in card and "| 8 | 12.0 | 1.20x | 1.00x | 1.10 |" in card
    assert "speedup_bs1, value: 2.400" in card and "| 1 | 10.0 | 1.00x" not in card


def test_export_sets_a_draft_vocabulary_from_distilled_data(tmp_path):
    from datasets import Dataset
    from transformers import AutoModel

    make_drafter(make_target("llama")).save_pretrained(tmp_path / "trained")
    Dataset.from_list([{"input_ids": [1, 2, 9, 9, 7], "prompt_length": 2},
                       {"input_ids": [2, 7, 9, 5], "prompt_length": 1}]).save_to_disk(str(tmp_path / "data"))
    export = ["export", "--drafter", str(tmp_path / "trained"), "--output", str(tmp_path / "hub")]
    cli.main(export + ["--draft-vocab-size", "2", "--draft-vocab-data", str(tmp_path / "data")])
    exported = AutoModel.from_pretrained(tmp_path / "hub", trust_remote_code=True)
    assert exported.config.draft_vocab_size == 2 and exported.draft_vocab_ids.tolist() == [9, 7]  # 3 and 2 uses
    assert "draft vocabulary: 2 tokens" in (tmp_path / "hub" / "README.md").read_text()
    with pytest.raises(SystemExit):
        cli.main(export + ["--draft-vocab-size", "2"])


def test_export_sets_the_default_number_of_drafts(tmp_path):
    from transformers import AutoModel

    make_drafter(make_target("llama"), draft_length=4).save_pretrained(tmp_path / "trained")
    export = ["export", "--drafter", str(tmp_path / "trained"), "--output", str(tmp_path / "hub")]
    cli.main(export + ["--num-speculative-tokens", "3"])
    assert AutoModel.from_pretrained(tmp_path / "hub", trust_remote_code=True).config.num_speculative_tokens == 3
    assert "default k = 3" in (tmp_path / "hub" / "README.md").read_text()
    with pytest.raises(SystemExit):
        cli.main(export + ["--num-speculative-tokens", "5"])


def test_export_companion_writes_a_loadable_folder_with_a_card_of_its_measurements(tmp_path):
    from conftest import make_companion
    from transformers import AutoModel

    companion = make_companion(make_target("llama")).set_vocab([3, 5, 8])
    companion.config.acceptance_table = {"signal": "sv", "edges": [[0.5], [0.5]], "num_slots": 1,
                                         "rate": [0.5] * 8, "trials": [4.0] * 8, "expected_accepted": [0.0, 0.5]}
    companion.save_pretrained(tmp_path / "trained")
    scores = {"auc": 0.7, "brier": 0.2, "information_gain_bits": 0.12}
    calibration = {"evaluation_drafts": 900, "fit_drafts": 1000, "num_draft_tokens": 3,
                   "confidence_table": scores, "sv_table": {**scores, "auc": 0.8},
                   "cost_seconds_per_step_b32": {"confidence_table": 1e-4, "sv_table": 2e-3}}
    (tmp_path / "calibration.json").write_text(json.dumps(calibration))
    cli.main(["export-companion", "--companion", str(tmp_path / "trained"), "--output", str(tmp_path / "hub"),
              "--calibration", str(tmp_path / "calibration.json"), "--dtype", "float32"])
    loaded = AutoModel.from_pretrained(tmp_path / "hub", trust_remote_code=True)
    assert loaded.vocab_ids.tolist() == [3, 5, 8] and loaded.config.acceptance_table["signal"] == "sv"
    card = (tmp_path / "hub" / "README.md").read_text()
    assert "| (c) SV (S, A) table with this companion | 0.800 | 0.2000 | 0.1200 | 2.00 ms |" in card
    assert "acceptance_auc_sv_table, value: 0.800" in card and "custom_generate" not in os.listdir(tmp_path / "hub")


def test_device_and_dtype_options_reach_the_tools():
    from hf_specformer.apps.demo import build_parser as demo_parser
    from hf_specformer.training.distill import parse_args as distill_args
    from hf_specformer.training.train_drafter import parse_config

    options = ["--device", "cpu", "--dtype", "bfloat16"]
    assert vars(build_parser().parse_args(["--output", "o", *options])).items() >= \
        {"device": "cpu", "dtype": "bfloat16"}.items()
    assert vars(demo_parser().parse_args(options)).items() >= {"device": "cpu", "dtype": "bfloat16"}.items()
    assert vars(distill_args(["--output", "o", *options])).items() >= {"device": "cpu", "dtype": "bfloat16"}.items()
    assert parse_config(["--data", "d", "--output-dir", "o", "--target-dtype", "float16"]).target_dtype == "float16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--output", "o", "--dtype", "int8"])


def test_bench_rounds_reverse_the_order_and_count_every_row(tmp_path):
    """A whole benchmark on a tiny target (the untrained drafter and an oracle, 2 rounds): every round's rows are
    counted and identical to plain `generate`, and the JSON and the plot are written."""
    import torch

    from hf_specformer.apps.bench import main as bench_main
    from hf_specformer.targets import load_tokenizer

    tokenizer = load_tokenizer()
    tiny_chat_target(tokenizer).float().save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CHAT_PROMPTS))
    threads = torch.get_num_threads()
    report = bench_main(["--target", str(tmp_path / "target"), "--drafter", "untrained", "--oracle",
                         "--schedules", "fixed", "--batch-sizes", "1", "2", "--min-rows", "2", "--max-new-tokens", "6",
                         "--rounds", "2", "--threads", "1", "--prompts", str(tmp_path / "p.jsonl"),
                         "--output", str(tmp_path / "bench")])
    torch.set_num_threads(threads)
    rows = report["results"]
    assert {row["call"] for row in rows} == {"plain", "plain+cpu", "ours [fixed]", "oracle [fixed]"}
    assert sorted({(row["batch_size"], row["batches"], row["rounds"], row["rows"]) for row in rows}) == \
        [(1, 2, 2, 4), (2, 1, 2, 4)]
    assert all(row["mismatched_rows"] == 0 and row["seconds"] > 0 for row in rows)
    assert all(row["kappa"] > 1.5 for row in rows if row["call"] == "oracle [fixed]")
    assert (tmp_path / "bench.png").exists()
    machine = json.loads((tmp_path / "bench.json").read_text())["machine"]
    assert machine["threads"] == 1 and (machine["device"], machine["dtype"]) == ("cpu", "float32")
    with pytest.raises(SystemExit, match="batch size, 8, needs as many prompts"):
        bench_main(["--target", str(tmp_path / "target"), "--drafter", "untrained", "--batch-sizes", "8",
                    "--prompts", str(tmp_path / "p.jsonl"), "--output", str(tmp_path / "bench8")])


def test_the_host_overhead_mode_splits_each_calls_time_by_phase():
    import torch

    from hf_specformer.apps.bench import host_overhead

    threads = torch.get_num_threads()
    rows = host_overhead([1, 2], new_tokens=8, prompt_length=4, repeats=1)  # raises if any output differs
    torch.set_num_threads(threads)
    assert [(row["batch_size"], row["call"]) for row in rows][:5] == [
        (1, "plain generate"), (1, "perfect drafts, k = 3"), (1, "perfect drafts, k = 3, GQA_SDPA"),
        (1, "engine, no drafts"), (1, "k = 0")]
    for perfect in rows[1:3]:  # a prefill and 2 steps of 4 tokens (8 in all), each timed on its own target
        assert perfect["forwards"] == 1 + 2 and perfect["ms_drafting"] > 0 and perfect["ms_target_forward"] > 0
    assert all(row["ms_target_forward"] + row["ms_drafting"] + row["ms_rest"] ==
               pytest.approx(row["ms_per_forward"]) for row in rows)
