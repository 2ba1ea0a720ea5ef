"""What every benchmark shares: model folders and their shapes, KV pool sizing, and measurements run
in fresh interpreters (`python -m <module> --child SPEC.json`, the module's `child_main`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ops.bench.workloads import Workload

REPO = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16


# --- models ----------------------------------------------------------------------------------------


def resolve_model(name: str, quick: bool = False) -> Path:
    """A model folder from `--model`: a path, "smollm2" (prepared once), or "tiny" (a random-weight
    Llama built once under the pagedq cache). Default: tiny in quick mode, SmolLM2 otherwise."""
    name = name or ("tiny" if quick else "smollm2")
    if name == "smollm2":
        from worker.models.prepare import prepare

        return prepare("smollm2")
    if name == "tiny":
        from worker.models.prepare import cache_root
        from worker.models.tiny import build_tiny_model

        out = cache_root().parent / "bench" / "tiny-llama"
        if not (out / "config.json").exists():
            build_tiny_model("llama", out, seed=0)
        return out
    path = Path(name).expanduser()
    if not (path / "config.json").exists():
        raise SystemExit(f"--model {name}: no config.json there (give a folder, 'smollm2' or 'tiny')")
    return path


def model_info(model_dir: str | Path) -> dict[str, Any]:
    """Shape numbers of a Llama-family config.json, and its matmul parameter counts."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    nh = c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nh
    hd = c.get("head_dim") or h // nh
    inter, vocab = c["intermediate_size"], c["vocab_size"]
    per_layer = h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 3 * h * inter
    return {
        "name": c.get("_name_or_path") or Path(model_dir).name,
        "folder": Path(model_dir).name,
        "model_type": c.get("model_type"),
        "hidden_size": h,
        "layers": layers,
        "heads": nh,
        "kv_heads": nkv,
        "head_dim": hd,
        "vocab_size": vocab,
        # Prompt ids are drawn below this: the model's vocabulary, or the tokenizer's if smaller (a
        # random-weight model may carry a borrowed tokenizer).
        "prompt_vocab": min(vocab, _tokenizer_size(model_dir) or vocab),
        "max_model_len": c.get("max_position_embeddings") or 2048,
        "matmul_params_layers": layers * per_layer,
        "matmul_params_lm_head": h * vocab,
        "kv_bytes_per_token_bf16": 2 * layers * nkv * hd * 2,
    }


def _tokenizer_size(model_dir: str | Path) -> int | None:
    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)


def kv_blocks_for(workload: Workload, max_model_len: int) -> int:
    """A KV pool that holds every request at full length at once (plus one spare block each)."""
    need = sum(math.ceil(r.total_tokens / BLOCK_SIZE) + 1 for r in workload.requests)
    return max(need, math.ceil(max_model_len / BLOCK_SIZE))


def kv_options(items: list[str]) -> dict:
    """k=v engine options (ints, floats, booleans parsed), e.g. of --engine-arg."""
    out: dict = {}
    for item in items or []:
        k, _, v = item.partition("=")
        low = v.lower()
        if low in ("true", "false"):
            out[k.replace("-", "_")] = low == "true"
            continue
        for conv in (int, float):
            try:
                out[k.replace("-", "_")] = conv(v)
                break
            except ValueError:
                continue
        else:
            out[k.replace("-", "_")] = v
    return out


# --- subprocesses ----------------------------------------------------------------------------------


def stop_process(proc: subprocess.Popen | None, log=None) -> None:
    """SIGTERM a measured server process, SIGKILL it after 30 s, and close its log file."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if log is not None:
        log.close()


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]),
    )
    return env


def run_child(spec: dict, tmp: Path, timeout: float, module: str) -> dict:
    """Run one measurement (`python -m <module> --child SPEC`) in a fresh interpreter; its JSON result,
    or {"error": ...} with the tail of its output."""
    tag = f"{spec['system']}-{uuid.uuid4().hex[:8]}"
    spec_path, out_path, log_path = tmp / f"{tag}.spec.json", tmp / f"{tag}.out.json", tmp / f"{tag}.log"
    spec_path.write_text(json.dumps({**spec, "out": str(out_path)}))
    cmd = [sys.executable, "-m", module, "--child", str(spec_path)]
    t0 = time.monotonic()
    with log_path.open("wb") as log:
        try:
            rc = subprocess.run(
                cmd, cwd=REPO, env=child_env(spec["threads"]), stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    if rc == 0 and out_path.exists():
        return json.loads(out_path.read_text())
    tail = log_path.read_text(errors="replace")[-3000:]
    why = f"timed out after {timeout:.0f}s" if rc is None else f"exit code {rc}"
    return {"error": f"{spec['system']}: {why} after {time.monotonic() - t0:.0f}s\n{tail}"}


def child_entry(child_main: Callable[[str], int], argv: list[str] | None = None) -> int:
    """The `__main__` of a module with a child side: `--child SPEC.json` runs one measurement."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--child":
        return child_main(argv[1])
    print(
        "this module only runs one measurement for the harness (--child SPEC.json); run the benchmarks "
        "with `python -m ops.bench COMMAND ...` or `pagedq bench COMMAND ...`",
        file=sys.stderr,
    )
    return 2
