"""A drafter for your own model, end to end through the command line: a tiny Qwen3 target saved with SmolLM2's
tokenizer, `distill`, `train` (its target taken from the data), `export`, then `target.generate(assistant_model=,
custom_generate=)` equal to plain greedy; and each refusal, as one line and exit status 2."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CHAT_PROMPTS
from transformers import AutoModel, AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hf_specformer.apps import cli


def _qwen3_target(tokenizer, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return Qwen3ForCausalLM(config).eval()


def _error_line(capsys, argv: list[str]) -> str:
    """The one line a refused command ends with (progress bars before it aside), after exit status 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]
    assert exit_info.value.code == 2 and "Traceback" not in err and last.startswith(f"hf-specformer {argv[0]}: error: ")
    return last


def test_a_drafter_for_a_new_target_from_distill_to_generate(tmp_path, tokenizer, capsys):
    target_dir, other_dir, data, run, hub = (tmp_path / name for name in ("target", "other", "data", "run", "hub"))
    for folder, seed in ((target_dir, 0), (other_dir, 1)):
        _qwen3_target(tokenizer, seed).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CHAT_PROMPTS))
    distill = ["distill", "--target", str(target_dir), "--prompts", str(tmp_path / "prompts.jsonl"),
               "--output", str(data), "--batch-size", "3"]
    cli.main([*distill, "--max-new-tokens", "24"])
    assert f"answers of {target_dir}, " in capsys.readouterr().out  # the summary
    assert json.loads((data / "progress" / "meta.json").read_text())["target"] == str(target_dir)

    # a changed run, another target, a missing folder: one line each, exit status 2
    changed = _error_line(capsys, [*distill, "--max-new-tokens", "12"])
    assert "describes a different run" in changed and "max_new_tokens" in changed
    train = ["train", "--data", str(data), "--output-dir", str(run), "--max-steps", "4", "--draft-length", "2",
             "--per-device-batch-size", "2", "--eval-fraction", "0.34", "--num-threads", "1", "--save-dtype",
             "float32"]
    other = _error_line(capsys, [*train, "--target", str(other_dir)])
    assert f"was distilled from {target_dir}, not from the target given ({other_dir})" in other
    smollm2 = _error_line(capsys, [*train, "--target", "smollm2"])
    assert "not from the target given (smollm2)" in smollm2
    missing = _error_line(capsys, ["train", "--data", str(tmp_path / "nowhere"), "--output-dir", str(run)])
    assert "No distilled data" in missing

    cli.main(train)  # no --target: the data's
    assert f"wrote {run / 'drafter'}: 4 steps, final loss " in capsys.readouterr().out
    evaluation = json.loads((run / "eval.json").read_text())  # strict JSON: no NaN
    assert len(evaluation["kappa"]) == 2
    cli.main(["calibrate", "--data", str(data), "--drafter", str(run / "drafter"), "--write"])  # the data's target
    assert "calibrated on 6 sequences at k = 2 (acceptance " in capsys.readouterr().out
    assert json.loads((run / "drafter" / "config.json").read_text())["acceptance_table"]["num_slots"] == 2
    cli.main(["export", "--drafter", str(run / "drafter"), "--output", str(hub), "--eval", str(run / "eval.json"),
              "--dtype", "float32"])
    summary = capsys.readouterr().out
    assert f"wrote {hub}: k = " in summary and "held-out kappa" in summary
    card = (hub / "README.md").read_text()
    assert "# hub\n" in card and ".drafter" not in card
    evaluate = ["eval-drafter", "--drafter", str(hub), "--prompts", str(tmp_path / "prompts.jsonl"),
                "--limit-per-group", "1", "--max-new-tokens", "8", "--num-draft-tokens", "2", "--with-suffix",
                "--suffix-corpus", str(data), "--output", str(tmp_path / "eval")]
    assert "not from the target given (smollm2)" in _error_line(capsys, [*evaluate, "--target", "smollm2"])
    cli.main(evaluate)  # no --target: the suffix corpus' data's
    assert json.loads((tmp_path / "eval.json").read_text())["groups"]["all"]["live_suffix"]

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()  # no near-ties
    drafter = AutoModel.from_pretrained(hub, trust_remote_code=True)
    assert drafter.config.target_name_or_path == str(target_dir)
    inputs = tokenizer([p for p in CHAT_PROMPTS[:4]], return_tensors="pt", padding=True)
    plain = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    ours = target.generate(**inputs, assistant_model=drafter, custom_generate=str(hub), trust_remote_code=True,
                           max_new_tokens=16, do_sample=False)
    assert torch.equal(ours, plain)
