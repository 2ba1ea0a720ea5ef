"""The model's own sampling defaults, from its generation_config.json (vLLM's `--generation-config`).

`auto` (the default) reads the model folder's file, `vllm` ignores it (vLLM's neutral defaults), and
any other value is a folder holding a generation_config.json. Of the file, only the fields a request
may leave unset (`MODEL_DEFAULT_FIELDS`: temperature, top_p, top_k, min_p, repetition_penalty) are
taken, and only those the file sets. A request's explicit values always win
(`SamplingParams.with_defaults`).

The file is read as plain JSON rather than through transformers' `GenerationConfig`, whose own
defaults (top_k=50, ...) would pass for the model's; `do_sample` is ignored, as vLLM does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from worker.engine.config import ConfigError
from worker.engine.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams, SamplingParamsError

GENERATION_CONFIG_FILE = "generation_config.json"
AUTO, VLLM = "auto", "vllm"


def load_generation_defaults(setting: str, model: str) -> dict[str, Any]:
    """The sampling defaults `setting` names for `model` (a folder or a .gguf file): {} for `vllm`, for a
    GGUF file, and for a model folder without a generation_config.json. ConfigError on a folder given
    explicitly that holds no such file, or on a file whose values no request could carry."""
    if setting == VLLM:
        return {}
    if setting == AUTO:
        folder = Path(model).expanduser()
        if not folder.is_dir():
            return {}
    else:
        folder = Path(setting).expanduser()
        if not (folder / GENERATION_CONFIG_FILE).is_file():
            raise ConfigError(
                f"--generation-config={setting!r}: no {GENERATION_CONFIG_FILE} there "
                "(choose auto, vllm or a folder that holds one)"
            )
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable JSON ({e}); --generation-config vllm ignores it") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a JSON object; --generation-config vllm ignores it")
    defaults = {name: raw[name] for name in MODEL_DEFAULT_FIELDS if raw.get(name) is not None}
    try:
        SamplingParams(**defaults)  # the rules every request's values follow
    except (SamplingParamsError, TypeError) as e:
        raise ConfigError(f"{path}: {e}; --generation-config vllm ignores the file") from e
    return defaults
