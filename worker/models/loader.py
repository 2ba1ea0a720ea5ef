"""Load a local Hugging Face folder (or a GGUF file) straight into the engine's model.

Safetensors are read tensor by tensor (memory-mapped) into parameters allocated once in the target
dtype and device, so the weights exist in memory once. GGUF goes through transformers' GGUF reader,
which de-quantizes into a transformers model first (two copies for a moment; GGUF is for convenience).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedq_kernels.cpu import native_bf16
from worker.models.cpu_linear import packing_enabled
from worker.models.quantization import QuantizationError, check_method
from worker.models.registry import model_class

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class ModelLoadError(ValueError):
    """The model cannot be loaded; the message says what is wrong with which file."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: object  # the transformers PretrainedConfig
    tokenizer_path: str
    gguf_file: str | None
    dtype: torch.dtype
    device: torch.device


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {device}: CUDA is not available on this machine")
    return dev


def resolve_dtype(dtype: str, config, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = _DTYPES.get(declared, torch.float32)
    chosen = declared if isinstance(declared, torch.dtype) else torch.float32
    if device.type == "cpu" and chosen in (torch.float16, torch.bfloat16):
        # fp16 matmuls are slow on CPUs; bf16 is fast only where the CPU does it natively.
        return torch.bfloat16 if bf16_is_fast(device) else torch.float32
    return chosen


def bf16_is_fast(device: torch.device) -> bool:
    """GPUs multiply bf16 natively; CPUs only with avx512_bf16/AMX (or Arm bf16): elsewhere torch
    emulates it, tens of times slower than fp32."""
    return device.type != "cpu" or native_bf16()


def load_config(model: str | Path):
    from transformers import AutoConfig

    path = Path(model)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: expected a model folder or a .gguf file")
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name), path
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
    try:
        return AutoConfig.from_pretrained(path), path
    except (ValueError, OSError, KeyError) as e:
        raise ModelLoadError(f"{path}/config.json cannot be read: {e}") from e


def _safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [folder / f for f in files]
    else:
        paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    for p in paths:
        if not p.exists():
            raise ModelLoadError(f"{p} is listed in the index but missing")
        with safe_open(str(p), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def _gguf_weights(path: Path, dtype: torch.dtype, config) -> Iterator[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    # With the config already read, transformers parses the file once more (for the tensors), not twice:
    # each parse of SmolLM2's GGUF metadata takes seconds.
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=dtype)
    yield from hf.state_dict().items()


def load_model(
    model: str | Path,
    *,
    dtype: str = "auto",
    device: str = "auto",
    tokenizer: str | None = None,
    max_positions: int | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    """`quantization="int8"`: the projections' weights quantized to int8 at load (worker/models/quantization.py,
    CPU only); None keeps the checkpoint's dtype."""
    config, path = load_config(model)
    cls = model_class(getattr(config, "architectures", None), getattr(config, "model_type", None))
    dev = resolve_device(device)
    try:
        check_method(quantization, dev)
    except QuantizationError as e:
        raise ModelLoadError(str(e)) from e
    torch_dtype = resolve_dtype(dtype, config, dev)
    with torch.device(dev):
        net = cls(config, torch_dtype, max_positions=max_positions)
    gguf = path.name if path.is_file() else None
    weights = _gguf_weights(path, torch_dtype, config) if gguf else _safetensors_weights(path)
    with torch.no_grad():
        net.load_weights(weights)
        if quantization:
            net.pack_linears(quantization=quantization)
        elif packing_enabled(dev, torch_dtype):
            net.pack_linears()
    net.eval()
    tok_path = tokenizer or str(path.parent if gguf else path)
    return LoadedModel(net, config, tok_path, gguf, torch_dtype, dev)


def load_tokenizer(path: str, gguf_file: str | None = None):
    from transformers import AutoTokenizer

    try:
        return (
            AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
            if gguf_file
            else AutoTokenizer.from_pretrained(path)
        )
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"tokenizer at {path} cannot be loaded: {e}") from e
