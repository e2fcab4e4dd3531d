"""Runs one padded forward pass over a batch of slots; target and draft model share it."""

from __future__ import annotations

import torch

from cluster.engine.attention import AttnContext, make_backend
from cluster.engine.kv_cache import KVCache
from cluster.engine.model import CausalLM


class Runner:
    def __init__(self, model: CausalLM, kv: KVCache, attention: str = "auto", graph_width: int = 0):
        self.model = model
        self.kv = kv
        p = next(model.parameters())
        self.device = p.device
        if model.backend is None:
            model.backend = make_backend(attention, p.device, p.dtype)
        self.graphs = None
        if graph_width and model.backend.name == "fa3":  # decode/verify steps up to this width
            from cluster.engine.graphs import GraphRunner

            self.graphs = GraphRunner(model, kv, graph_width)

    @torch.inference_mode()
    def forward(self, slots: list[int], cache_lens: list[int], tokens: list[list[int]],
                last_only: bool, num_layers: int | None = None) -> torch.Tensor:
        """Append `tokens[b]` to slot `slots[b]` (after `cache_lens[b]` cached tokens).

        Returns fp32 logits: [B, V] for each row's last token, or [B, T, V] for every
        (padded) position when `last_only` is False.
        """
        q_lens = [len(t) for t in tokens]
        if self.graphs is not None and self.graphs.eligible(len(tokens), max(q_lens)):
            logits = self.graphs.forward(slots, cache_lens, tokens, num_layers)
            if last_only:
                return logits[torch.arange(len(tokens), device=self.device), torch.tensor(q_lens, device=self.device) - 1]
            return logits
        ctx = AttnContext.build(slots, cache_lens, q_lens, self.device)
        assert ctx.max_kv <= self.kv.capacity, "slot capacity exceeded"
        ids = torch.zeros((len(tokens), ctx.width), dtype=torch.int64)
        for b, t in enumerate(tokens):
            ids[b, : len(t)] = torch.tensor(t)
        h = self.model(ids.to(self.device), ctx.positions, self.kv, ctx, num_layers)
        if last_only:
            h = h[torch.arange(len(tokens), device=self.device), ctx.q_lens - 1]
        return self.model.logits(h)
