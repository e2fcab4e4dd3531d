"""Loading a model directory: a Hugging Face one, or an embedded demo model (embed.json)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cluster.engine.worker.embedded import load_embedded
from cluster.engine.worker.model import CausalLM, load_hf_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # models.dtype


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str, group=None) -> CausalLM:
    """A Hugging Face directory (config.json + safetensors), or a directory with embed.json: a
    small trained model built into a larger shape (cluster.engine.worker.embedded). With `group`
    (cluster.engine.distributed.parallel), this tensor-parallel rank's part only."""
    path = Path(path)
    if (path / "embed.json").is_file():
        return load_embedded(path, dtype, device, group)
    return load_hf_model(path, dtype, device, group)


def load_tokenizer(path: str | Path):
    """The tokenizer of a model directory; an embedded model (embed.json) uses its source's."""
    from transformers import AutoTokenizer

    path = Path(path)
    if (path / "embed.json").is_file():
        return load_tokenizer((path / json.loads((path / "embed.json").read_text())["source"]).resolve())
    return AutoTokenizer.from_pretrained(path)
