"""The exported drafter folder serves weights, code and `custom_generate/` without the package installed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import CPU_ONLY, make_drafter, make_target
from generation.helpers import make_batch

from hf_specformer.hub import export_drafter


@CPU_ONLY
@pytest.mark.parametrize("writer", ["export_drafter", "save_pretrained"])
def test_custom_generate_in_clean_process(tmp_path, writer):
    """Either way of writing the folder (`export_drafter`, or the model's own `save_pretrained`) gives a folder that
    serves `custom_generate` with nothing of this package installed."""
    target = make_target("qwen3")
    drafter = make_drafter(target)
    if writer == "export_drafter":
        folder = export_drafter(drafter, tmp_path / "drafter")
    else:
        folder = tmp_path / "drafter"
        drafter.save_pretrained(folder)
    assert (folder / "custom_generate" / "generate.py").exists() and (folder / "README.md").exists()
    target.save_pretrained(tmp_path / "target")
    input_ids, mask = make_batch(4, seed=9)
    torch.save({"input_ids": input_ids, "attention_mask": mask}, tmp_path / "inputs.pt")
    script = textwrap.dedent(
        f"""
        import importlib.util, torch
        assert importlib.util.find_spec("hf_specformer") is None, "the package must not be importable"
        from transformers import AutoModel, AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained({str(tmp_path / "target")!r}, dtype=torch.float64).eval()
        draft = AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True, dtype=torch.float64).eval()
        inputs = torch.load({str(tmp_path / "inputs.pt")!r})
        plain = target.generate(**inputs, max_new_tokens=12, do_sample=False)
        out = target.generate(**inputs, assistant_model=draft, custom_generate={str(folder)!r},
                              trust_remote_code=True, max_new_tokens=12, do_sample=False,
                              return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain), (out.sequences, plain)
        print("steps", out.speculation_stats.steps, type(out).__module__)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    # -S then site.main(): site-packages without the editable install's path hook for hf_specformer.
    bootstrap = (
        "import site, sys; site.main(); "
        "sys.path[:] = [p for p in sys.path if not p.endswith('/src')]; "
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__.lower()]; "
        "exec(sys.stdin.read())"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", bootstrap], input=script, capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "custom_generate" in result.stdout
