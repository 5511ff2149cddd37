"""Speculative Verification companion: shapes, vocabulary, causality over the chain, Hub round trip, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import TINY_VOCAB, make_companion, make_target

from hf_specformer import CompanionConfig, CompanionForVerification


def inputs(batch: int = 3, length: int = 4, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(batch, 48, generator=generator, dtype=torch.float64)
    return states, torch.randint(3, TINY_VOCAB, (batch, length), generator=generator)


def test_logits_cover_the_chain_and_only_the_companion_vocabulary(target):
    companion = make_companion(target)
    states, chain = inputs()
    assert companion(hidden_states=states, input_ids=chain).logits.shape == (3, 4, TINY_VOCAB)
    vocab = [5, 9, 40, 41, 77]
    logits = companion.set_vocab(vocab)(hidden_states=states, input_ids=chain).logits
    finite = torch.isfinite(logits).nonzero()[:, 2].unique().tolist()
    assert finite == sorted(vocab)
    assert companion.config.companion_vocab_size == 5


def test_position_j_reads_only_the_chain_up_to_j(target):
    """Causal over the chain: changing token j changes the logits at positions >= j only."""
    companion = make_companion(target)
    states, chain = inputs(batch=1, length=5)
    changed = chain.clone()
    changed[0, 2] = (chain[0, 2] + 7) % TINY_VOCAB
    before = companion(hidden_states=states, input_ids=chain).logits
    after = companion(hidden_states=states, input_ids=changed).logits
    assert torch.equal(before[:, :2], after[:, :2])
    assert not torch.allclose(before[:, 2:], after[:, 2:])


def test_bad_inputs_and_targets_are_rejected(target):
    companion = make_companion(target)
    states, chain = inputs(length=9)
    with pytest.raises(ValueError, match="chain of 9"):
        companion(hidden_states=states, input_ids=chain)
    with pytest.raises(ValueError, match=r"hidden_states \[B, d\]"):
        companion(hidden_states=states[None], input_ids=chain[:, :3])
    with pytest.raises(ValueError, match="distinct"):
        companion.set_vocab([1, 1, 2])
    other = make_target("qwen3" if target.config.model_type == "llama" else "llama")
    with pytest.raises(ValueError, match="model_type"):
        make_companion(target).bind_target(other)
    unbound = CompanionForVerification(CompanionConfig.from_target_config(target.config, companion_size=16,
                                                                          num_attention_heads=2))
    with pytest.raises(RuntimeError, match="bind_target"):
        unbound(hidden_states=states.float(), input_ids=chain[:, :3])
    with pytest.raises(ValueError, match="multiple"):
        CompanionConfig(companion_size=30, num_attention_heads=4)


def test_save_and_load_with_remote_code_in_a_clean_process(tmp_path, target):
    """`save_pretrained` writes auto_map and the model files; a process without hf_specformer loads the folder
    with trust_remote_code and computes the same logits (the vocabulary and the table travel with it)."""
    save_dir = tmp_path / "companion"
    companion = make_companion(target).set_vocab([4, 8, 15, 16, 23, 42])
    companion.config.acceptance_table = {"signal": "sv", "note": "travels in config.json"}
    companion.save_pretrained(save_dir)
    config = json.loads((save_dir / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_companion.CompanionConfig",
        "AutoModel": "modeling_companion.CompanionForVerification",
    }
    assert config["acceptance_table"]["note"] == "travels in config.json"
    assert {"configuration_companion.py", "modeling_companion.py"} <= set(os.listdir(save_dir))
    states, chain = inputs()
    torch.save({"states": states, "chain": chain, "target": target.state_dict()}, tmp_path / "inputs.pt")
    expected = companion(hidden_states=states, input_ids=chain).logits
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:] = [p for p in sys.path if "hf_specformer" not in p and not p.endswith("/src")]
        import torch
        from transformers import AutoModel, {type(target).__name__}, {type(target.config).__name__}
        companion = AutoModel.from_pretrained({str(save_dir)!r}, trust_remote_code=True, dtype=torch.float64).eval()
        target = {type(target).__name__}({type(target.config).__name__}.from_dict({target.config.to_dict()!r}))
        saved = torch.load({str(tmp_path / "inputs.pt")!r})
        target.load_state_dict(saved["target"])
        companion.bind_target(target.double().eval())
        logits = companion(hidden_states=saved["states"], input_ids=saved["chain"]).logits
        torch.save(logits, {str(tmp_path / "out.pt")!r})
        print(type(companion).__module__)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "transformers_modules" in result.stdout  # the class came from the folder's remote code
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)
