"""Real-size model shapes with random weights, for speed work on a GPU (acceptance is
measured on trained pairs; random weights only tell time)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from cluster.engine.worker.embedded import LLAMA_8B, random_model
from cluster.engine.worker.model import CausalLM


def random_llama(layers: int | None = None, device: str = "cuda", dtype=torch.bfloat16, seed: int = 0) -> CausalLM:
    """Llama-3.1-8B dimensions (or its first `layers` layers), weights ~ N(0, 0.02), norms 1."""
    cfg = LlamaConfig(**{**LLAMA_8B, **({"num_hidden_layers": layers} if layers else {})})
    return random_model(cfg, device, dtype, seed).eval()


class NullTokenizer:
    """Token ids only: for speed runs on random weights, where text means nothing."""
    eos_token_id = -1

    def encode(self, s: str) -> list[int]:
        return [1 + (ord(c) % 1000) for c in s]

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""
