"""SpecFormer drafter: architecture behaviour, cache equivalence, Hub round trip, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import make_drafter, make_target
from transformers.cache_utils import DynamicCache

from hf_specformer import SpecFormerConfig, SpecFormerForDrafting


def hooked_states(target, draft, input_ids):
    with torch.no_grad():
        out = target(input_ids, output_hidden_states=True)
    return draft.select_hooked_states(out.hidden_states)


def test_config_from_target_copies_dimensions(target):
    config = SpecFormerConfig.from_target_config(target.config, draft_length=6)
    text = target.config
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        text.hidden_size,
        text.num_attention_heads,
        text.num_key_value_heads,
    )
    assert config.head_dim == (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    assert config.rope_parameters["rope_theta"] == text.rope_parameters["rope_theta"]
    assert (config.rms_norm_eps, config.intermediate_size, config.vocab_size) == (
        text.rms_norm_eps,
        text.intermediate_size,
        text.vocab_size,
    )
    layers = text.num_hidden_layers
    assert config.hook_layers == [0, layers // 2, layers - 1, layers]
    assert config.target_model_type == text.model_type
    assert config.draft_length == 6 and config.num_speculative_tokens == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"draft_length": 0}, "draft_length"),
        ({"hook_layers": [0, 1, 2]}, "exactly 4"),
        ({"draft_length": 2, "num_speculative_tokens": 3}, "num_speculative_tokens"),
    ],
)
def test_config_rejects_bad_values(target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpecFormerConfig.from_target_config(target.config, **kwargs)


def test_cache_equivalence_chunked_vs_full(target, drafter):
    torch.manual_seed(3)
    input_ids = torch.randint(3, 90, (3, 17))
    states = hooked_states(target, drafter, input_ids)
    positions = torch.arange(17)[None].expand(3, -1)
    full = drafter(states, draft_positions=positions)

    cache, chunks = DynamicCache(), [(0, 5), (5, 6), (6, 13), (13, 17)]
    for start, end in chunks:
        piece = drafter(
            [s[:, start:end] for s in states],
            past_key_values=cache,
            draft_positions=torch.arange(end - start)[None].expand(3, -1),
        )
        torch.testing.assert_close(piece.logits, full.logits[:, start:end], rtol=1e-10, atol=1e-10)
    assert cache.get_seq_length() == 17


def test_next_token_input_starts_at_zero_from_a_plain_checkpoint(target, drafter, tmp_path):
    """A drafter saved without the extension and loaded with it drafts exactly as before (W_E starts at zero)."""
    drafter.save_pretrained(tmp_path)
    extended = SpecFormerForDrafting.from_pretrained(tmp_path, dtype=torch.float64, next_token_input=True)
    extended = extended.eval().bind_target(target)
    assert extended.context_block.next_token_input.weight.abs().max() == 0
    input_ids = torch.randint(3, 90, (2, 9))
    states = hooked_states(target, drafter, input_ids)
    torch.testing.assert_close(extended(states, next_token_ids=input_ids).logits, drafter(states).logits)


def test_next_token_input_is_read_and_cached(target):
    """With a trained (non-zero) W_E: the next tokens change the drafts, chunked and full forwards agree, and
    leaving them out raises."""
    drafter = make_drafter(target, next_token_input=True)
    torch.nn.init.normal_(drafter.context_block.next_token_input.weight, std=0.3)
    torch.manual_seed(6)
    input_ids, next_ids = torch.randint(3, 90, (2, 11)), torch.randint(3, 90, (2, 11))
    states = hooked_states(target, drafter, input_ids)
    positions = torch.arange(11)[None].expand(2, -1)
    full = drafter(states, draft_positions=positions, next_token_ids=next_ids).logits
    other = drafter(states, draft_positions=positions, next_token_ids=next_ids.roll(1, dims=1)).logits
    assert not torch.allclose(full, other)
    cache = DynamicCache()
    for start, end in [(0, 4), (4, 5), (5, 11)]:
        piece = drafter([s[:, start:end] for s in states], past_key_values=cache,
                        next_token_ids=next_ids[:, start:end],
                        draft_positions=torch.arange(end - start)[None].expand(2, -1)).logits
        torch.testing.assert_close(piece, full[:, start:end], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="next_token_ids"):
        drafter(states)


def test_padding_mask_hides_keys(target, drafter):
    """A row with left padding gives the same drafts as the unpadded row alone."""
    torch.manual_seed(4)
    ids = torch.randint(3, 90, (1, 9))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 9)], dim=1).long()
    with torch.no_grad():
        plain_states = drafter.select_hooked_states(target(ids, output_hidden_states=True).hidden_states)
        padded_out = target(padded, attention_mask=mask, output_hidden_states=True,
                            position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    padded_states = drafter.select_hooked_states(padded_out.hidden_states)
    plain = drafter(plain_states).logits
    masked = drafter(padded_states, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    torch.testing.assert_close(masked, plain, rtol=1e-9, atol=1e-9)


def test_slot_attention_is_bidirectional(target, drafter):
    """Perturbing the last slot's input changes the first slot's output (no causal mask across slots)."""
    context = torch.randn(2, 3, drafter.config.hidden_size, dtype=torch.float64)
    slot_block = drafter.slot_block
    baseline = slot_block(context, num_draft_tokens=drafter.config.draft_length)

    bias = slot_block.positional_proj.bias
    hidden = drafter.config.hidden_size
    with torch.no_grad():
        bias[-hidden:] += 1.0  # only the last slot's positional-FFN output moves
    perturbed = slot_block(context, num_draft_tokens=drafter.config.draft_length)
    assert not torch.allclose(perturbed[:, :, 0], baseline[:, :, 0])


def test_draft_length_truncates(target, drafter):
    states = hooked_states(target, drafter, torch.randint(3, 90, (2, 7)))
    full = drafter(states, num_draft_tokens=drafter.config.draft_length, use_cache=False).logits
    for k in range(1, drafter.config.draft_length + 1):
        out = drafter(states, num_draft_tokens=k, use_cache=False).logits
        assert out.shape == (2, 1, k, target.config.vocab_size)
        torch.testing.assert_close(out, full[:, :, :k], rtol=1e-12, atol=1e-12)


def test_logits_at_requested_positions_are_those_of_every_position(target, drafter):
    """Drafting at chosen positions (default: the last) gives what drafting at every position gives there."""
    states = hooked_states(target, drafter, torch.randint(3, 90, (2, 7)))
    every = drafter(states, draft_positions=torch.arange(7).expand(2, -1), use_cache=False).logits  # [2, 7, k, V]
    assert every.shape == (2, 7, drafter.config.num_speculative_tokens, target.config.vocab_size)
    torch.testing.assert_close(drafter(states, use_cache=False).logits, every[:, 6:], rtol=1e-12, atol=1e-12)
    chosen = torch.tensor([[0, 6], [3, 4]])
    out = drafter(states, draft_positions=chosen, use_cache=False).logits
    torch.testing.assert_close(out, every[torch.arange(2)[:, None], chosen], rtol=1e-12, atol=1e-12)


def test_bad_inputs_raise(target, drafter):
    states = hooked_states(target, drafter, torch.randint(3, 90, (1, 5)))
    with pytest.raises(ValueError, match="exactly 4"):
        drafter(states[:3])
    with pytest.raises(ValueError, match="between 1 and"):
        drafter(states, num_draft_tokens=drafter.config.draft_length + 1)
    with pytest.raises(ValueError, match="hidden states"):
        drafter.select_hooked_states(states)


def test_binding_to_mismatched_target_raises(target):
    drafter = make_drafter(target)
    other = make_target("llama")
    other.config.num_hidden_layers = 7  # wrong layer count
    with pytest.raises(ValueError, match="num_hidden_layers"):
        drafter.bind_target(other)
    unbound = SpecFormerForDrafting(drafter.config).double()
    with pytest.raises(RuntimeError, match="bind_target"):
        unbound(hooked_states(target, drafter, torch.randint(3, 90, (1, 4))))


def test_draft_vocabulary_restricts_drafts(target, drafter):
    states = hooked_states(target, drafter, torch.randint(3, 90, (2, 6)))
    full = drafter(states, num_draft_tokens=3).logits
    ids = torch.tensor([50, 7, 3, 88, 21])
    restricted = drafter.set_draft_vocab(ids)(states, num_draft_tokens=3).logits
    assert drafter.config.draft_vocab_size == 5 and restricted.shape == full.shape
    torch.testing.assert_close(restricted[..., ids], full[..., ids], rtol=0, atol=1e-12)
    outside = torch.ones(full.shape[-1], dtype=torch.bool).index_fill_(0, ids, False)
    assert torch.isneginf(restricted[..., outside]).all()
    assert set(restricted.argmax(-1).unique().tolist()) <= set(ids.tolist())
    for bad in ([], [1, 1], [-1], [target.config.vocab_size]):
        with pytest.raises(ValueError, match="distinct token ids"):
            drafter.set_draft_vocab(bad)
    torch.testing.assert_close(drafter.set_draft_vocab(None)(states, num_draft_tokens=3).logits, full, rtol=0, atol=0)
    assert drafter.config.draft_vocab_size is None


def test_checkpoint_excludes_target_weights(target, drafter, tmp_path):
    drafter.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert not any("lm_head" in n or "embed" in n for n in names)
    assert sum(p.numel() for p in drafter.parameters()) < sum(p.numel() for p in target.parameters())


def test_hub_round_trip_in_clean_process(target, drafter, tmp_path):
    """Save, then load with trust_remote_code in a subprocess that cannot import hf_specformer (with a draft
    vocabulary, which travels in the weights)."""
    save_dir = tmp_path / "drafter"
    drafter.set_draft_vocab([9, 4, 60, 33, 12, 80]).save_pretrained(save_dir)
    config = json.loads((save_dir / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_specformer.SpecFormerConfig",
        "AutoModel": "modeling_specformer.SpecFormerForDrafting",
    }
    assert {"configuration_specformer.py", "modeling_specformer.py"} <= set(os.listdir(save_dir))

    torch.manual_seed(5)
    input_ids = torch.randint(3, 90, (2, 8))
    states = torch.stack(hooked_states(target, drafter, input_ids), dim=2)
    torch.save({"states": states, "target": target.state_dict()}, tmp_path / "inputs.pt")
    expected = drafter(states).logits
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path = [p for p in sys.path if "hf_specformer" not in p and not p.endswith("/src")]
        import importlib.util
        assert importlib.util.find_spec("hf_specformer") is None, "package must not be importable here"
        from transformers import AutoModel, AutoConfig, {type(target).__name__}, {type(target.config).__name__}
        draft = AutoModel.from_pretrained({str(save_dir)!r}, trust_remote_code=True, dtype=torch.float64).eval()
        target = {type(target).__name__}({type(target.config).__name__}.from_dict({target.config.to_dict()!r}))
        saved = torch.load({str(tmp_path / "inputs.pt")!r})
        target.load_state_dict(saved["target"])
        target = target.double().eval()
        draft.bind_target(target)
        torch.save(draft(saved["states"]).logits, {str(tmp_path / "out.pt")!r})
        print(type(draft).__module__)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    result = subprocess.run(
        [sys.executable, "-S", "-c", "import site; site.main(); exec(open(0).read())"],
        input=script, capture_output=True, text=True, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "transformers_modules" in result.stdout
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected, rtol=0, atol=0)
