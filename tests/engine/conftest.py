"""Tiny random Llama-family models saved in Hugging Face format, and a char tokenizer.

Random weights are enough to test exactness (parity, losslessness, rollback); the trained
demo pair is used where acceptance matters.
"""

from __future__ import annotations

import zlib

import pytest
import torch

VOCAB, EOS = 256, 255


class CharTokenizer:
    """Maps characters to ids 0..254; 255 is EOS. Only for the random test models."""
    eos_token_id = EOS

    def encode(self, s: str) -> list[int]:
        return [ord(c) % EOS for c in s]

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(i) for i in ids if i != EOS)


def save_random(path, kind: str, **over):
    import transformers as tf

    cfg_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                          "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[kind]
    kw = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=EOS)
    kw.update(over)
    torch.manual_seed(zlib.crc32(kind.encode()))  # str hash is salted per process
    model_cls(cfg_cls(**kw)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def random_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": save_random(root / "llama", "llama"),
        "llama_draft": save_random(root / "llama_draft", "llama", hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, intermediate_size=64),
        "qwen2": save_random(root / "qwen2", "qwen2", tie_word_embeddings=True),
        "mistral": save_random(root / "mistral", "mistral", head_dim=32),
    }


@pytest.fixture(scope="session")
def tokenizer():
    return CharTokenizer()
