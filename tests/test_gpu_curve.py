"""The GPU visit's prepared curve script (examples/gpu_curve.py), run on its tiny target on the CPU."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from hf_specformer import GQA_SDPA, generate
from hf_specformer.generation.proposers import SpecFormerProposer
from hf_specformer.models import SpecFormerConfig, SpecFormerForDrafting

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "gpu_curve.py"


@pytest.fixture(scope="module")
def curve():
    spec = importlib.util.spec_from_file_location("gpu_curve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_peaked_target_repeats_its_last_token(curve):
    target = curve.peaked_target(curve.TINY, "cpu", torch.bfloat16)
    ids = torch.randint(3, 1024, (4, 16), generator=torch.Generator().manual_seed(0))
    output = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(output[:, 16:], ids[:, -1:].expand(-1, 8))


def test_constant_rate_gives_kappa(curve):
    for kappa in (1.8, 2.2):
        rate = curve.constant_rate(kappa, 3)
        assert sum(rate**j for j in range(4)) == pytest.approx(kappa, abs=1e-9)
    assert curve.conditional_rates([0.5, 0.2, 0.05]) == pytest.approx([0.5, 0.4, 0.25])


def test_corrupted_oracle_accepts_at_its_rates_and_stays_lossless(curve):
    torch.manual_seed(0)
    target = curve.peaked_target(curve.TINY, "cpu", torch.float32)
    drafter = SpecFormerForDrafting(SpecFormerConfig.from_target_config(target.config, draft_length=4))
    drafter = drafter.eval().bind_target(target)
    ids = torch.randint(3, 1024, (16, 32), generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                  do_sample=False)
    reference = target.generate(**kwargs)
    rates = [0.6, 0.5, 0.4]
    proposer = curve.CorruptedOracle(SpecFormerProposer(drafter, 3), reference[:, 32:], rates, 1024)
    output = generate(target, assistant_model=proposer, **kwargs, return_dict_in_generate=True,
                      speculation_config={"schedule": "fixed", "lookup_ngram_size": 0})
    assert torch.equal(output.sequences, reference)
    unconditional = [0.6, 0.6 * 0.5, 0.6 * 0.5 * 0.4]
    assert output.speculation_stats.acceptance_by_position == pytest.approx(unconditional, abs=0.08)


def test_the_script_writes_its_report(curve, tmp_path):
    report = curve.main(["--tiny", "--device", "cpu", "--batch-sizes", "2", "--prompt-length", "16",
                         "--new-tokens", "8", "--rounds", "1", "--output", str(tmp_path / "curve")])
    written = json.loads((tmp_path / "curve.json").read_text())
    assert (tmp_path / "curve.png").exists() and written["results"] == report["results"]
    assert len(written["results"]) == 8 and all(row["rows_differing"] == 0 for row in written["results"])
    assert {row["call"] for row in written["results"]} == {"plain generate", *curve.acceptance_settings(3)}
    assert written["results"][-1]["schedule"] == f"fixed, {GQA_SDPA}"
