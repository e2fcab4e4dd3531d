"""A random EAGLE-3 head over a test target (exactness tests: acceptance is not the point)."""

from __future__ import annotations

import torch

from cluster.engine.drafters.eagle3_head import Eagle3Head, HeadConfig
from cluster.engine.drafters.eagle3_load import default_aux_layers


def random_head(target, draft_vocab: int, seed: int = 0, std: float = 0.3) -> Eagle3Head:
    """A head shaped like the target's layers over a draft vocabulary of every other id from
    10 on (d2t not the identity), sharing the target's embedding."""
    from transformers import LlamaConfig

    s = target.shape
    hf = LlamaConfig(hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                     intermediate_size=s.intermediate, vocab_size=s.vocab_size, max_position_embeddings=512,
                     num_hidden_layers=1, rms_norm_eps=s.eps)
    hc = HeadConfig(s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.eps, s.vocab_size, draft_vocab,
                    s.hidden, default_aux_layers(s.layers), max_positions=512)
    torch.manual_seed(seed)
    head = Eagle3Head(hc, hf)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name == "embed_tokens.weight":
                continue
            torch.nn.init.normal_(p, std=std) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        head.embed_tokens.weight = target.embed_tokens.weight
        ids = 10 + 2 * torch.arange(draft_vocab)  # draft_vocab <= (vocab - 10) / 2
        head.d2t.copy_(ids - torch.arange(draft_vocab))
    return head.eval()
