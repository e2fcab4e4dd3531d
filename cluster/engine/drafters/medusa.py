"""Medusa heads (Cai et al., 2024): a drafter with no second model.

Head k (1..K) reads the target's final-normed hidden state h_t of token t and predicts token
t+k+1 (the target's own head predicts t+1): logits_k = lm_head(h + SiLU(W_k h + b_k)), one
residual block per layer as in the paper. The projection is the target's lm_head, shared and
frozen, so a head adds D*D + D parameters (65k for the demo target) instead of D*V more, and
the file beside the target stays small; W_k starts at zero, so an untrained head predicts
what the target's head does and training starts from there.

The drafter combines the heads' top-k into a tree of candidate paths (a configurable sparse
tree, see `sparse_tree`) that the engine verifies in one pass (cluster.engine.worker.tree). Its
gamma is the tree's size: a request drafting gamma g gets the tree's first g nodes (an
ancestor-closed prefix, ordered by estimated acceptance). Backends without arbitrary masks
(FA3) get the top-1 chain instead: verifying each path as its own batch row would copy the
slot's KV prefix once per extra path per step (2 * layers * context * kv_heads * head_dim
elements, ~1 GB at 8k context for Llama-3.1-8B), which costs more than the paths gain.
"""

from __future__ import annotations

import heapq
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cluster.engine.drafters.base import Drafter, DraftOutput, DraftRequest, one_hot

HEADS_FILE, CONFIG_FILE = "medusa_heads.safetensors", "medusa_config.json"
CHAIN = [[0] * d for d in range(1, 9)]  # the top-1 path: a chain of up to 8


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # identity at start: the head begins as lm_head
        nn.init.zeros_(self.linear.bias)

    def forward(self, x):
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_layers: int = 1):
        super().__init__()
        self.hidden, self.num_heads, self.num_layers = hidden, num_heads, num_layers
        self.heads = nn.ModuleList(nn.Sequential(*(ResBlock(hidden) for _ in range(num_layers)))
                                   for _ in range(num_heads))

    def forward(self, h: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """h [..., D], lm_head [V, D] (the target's) -> fp32 logits [..., K, V]."""
        x = torch.stack([head(h) for head in self.heads], dim=-2)
        return F.linear(x.to(lm_head.dtype), lm_head).float()

    def save(self, target_dir: str | Path, meta: dict | None = None) -> Path:
        from safetensors.torch import save_file

        d = Path(target_dir)
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()}
        save_file(state, d / HEADS_FILE)
        cfg = {"num_heads": self.num_heads, "num_layers": self.num_layers, "hidden_size": self.hidden,
               "projection": "target lm_head (shared, frozen)", **(meta or {})}
        (d / CONFIG_FILE).write_text(json.dumps(cfg, indent=1) + "\n")
        return d / HEADS_FILE

    @classmethod
    def load(cls, target_dir: str | Path, dtype=torch.float32, device="cpu") -> tuple[MedusaHeads, dict]:
        from safetensors.torch import load_file

        d = Path(target_dir)
        if not (d / HEADS_FILE).is_file():
            raise FileNotFoundError(f"no {HEADS_FILE} in {d} (spec-cluster models train-medusa --target {d})")
        cfg = json.loads((d / CONFIG_FILE).read_text())
        heads = cls(cfg["hidden_size"], cfg["num_heads"], cfg["num_layers"])
        heads.load_state_dict(load_file(d / HEADS_FILE))
        return heads.to(device=device, dtype=dtype).eval(), cfg


def has_heads(target_dir: str | Path) -> bool:
    return (Path(target_dir) / HEADS_FILE).is_file()


def whole_lm_head(target_dir: str | Path, tied: bool) -> torch.Tensor:
    """The target's [V, D] output projection from its safetensors (the embedding where tied
    or where no lm_head is stored, as the model loader reads it)."""
    from safetensors import safe_open

    names = ("model.embed_tokens.weight", "embed_tokens.weight") if tied else ("lm_head.weight",)
    for f in sorted(p for p in Path(target_dir).glob("*.safetensors") if p.name != HEADS_FILE):
        with safe_open(f, "pt") as st:
            for key in names:
                if key in st.keys():  # noqa: SIM118 - safe_open is not a dict
                    return st.get_tensor(key)
    if not tied:
        return whole_lm_head(target_dir, tied=True)
    raise FileNotFoundError(f"no lm_head or embedding in the safetensors of {target_dir}")


def sparse_tree(score: Callable[[list[int]], float], depth: int, width: int, nodes: int) -> list[list[int]]:
    """Medusa's sparse tree: grow greedily by the candidate path most likely to be accepted
    whole, `score(path)` (path[d] = the rank taken from head d+1). Expected accepted tokens
    per step are 1 + the sum of the scores of the nodes, so each pick is the best next node.
    A child is only considered once its parent is in, so the list is parents first and every
    prefix of it is a tree: the drafter cuts it at gamma nodes."""
    heap = [(-score([i]), [i]) for i in range(width)]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < nodes:
        _, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < depth:
            for i in range(width):
                heapq.heappush(heap, (-score(path + [i]), path + [i]))
    return out


def independent_score(accuracy: list[list[float]]) -> Callable[[list[int]], float]:
    """prod_d accuracy[d][i_d]: the paper's estimate, heads taken as independent."""
    return lambda path: math.prod(accuracy[d][i] for d, i in enumerate(path))


def tree_parents(paths: list[list[int]]) -> list[int]:
    """Parent index of each path (-1: a child of the root); refuses a path before its parent."""
    index = {}
    parents = []
    for i, p in enumerate(paths):
        if not p or min(p) < 0:
            raise ValueError(f"tree path {p!r} must be a non-empty list of top-k ranks")
        if tuple(p) in index:
            raise ValueError(f"tree path {p!r} appears twice")
        if len(p) > 1 and tuple(p[:-1]) not in index:
            raise ValueError(f"tree path {p!r} comes before its parent {p[:-1]!r}")
        parents.append(index[tuple(p[:-1])] if len(p) > 1 else -1)
        index[tuple(p)] = i
    return parents


class MedusaDrafter(Drafter):
    """Proposes a tree of the heads' top-k from the target's last hidden state, which each
    request carries (`reads_hidden`). It shares the target's lm_head, so it runs in the
    verifier's process."""

    name = "medusa"
    reads_hidden = True

    def __init__(self, heads: MedusaHeads, lm_head: torch.Tensor, tree: list[list[int]], trees_ok: bool):
        """lm_head: the target's [V, D] projection; trees_ok: the attention backend verifies
        trees (else the top-1 chain is proposed)."""
        self.heads, self.lm_head = heads, lm_head
        if max(map(len, tree)) > heads.num_heads:
            raise ValueError(f"tree depth {max(map(len, tree))} > {heads.num_heads} heads")
        self.tree, self.parents = tree, tree_parents(tree)
        self.chain = CHAIN[: heads.num_heads]
        self.topk = max(max(p) for p in tree) + 1
        self.tree_ok = trees_ok

    @classmethod
    def for_target(cls, heads: MedusaHeads, target: nn.Module, tree: list[list[int]]) -> MedusaDrafter:
        """Heads over the target model `target` (a CausalLM): its lm_head, its backend's trees."""
        return cls(heads, target.lm_head.weight, tree, getattr(target.backend, "supports_tree", False))

    @classmethod
    def load(cls, target_dir: str | Path, target: nn.Module, tree: list[list[int]] | None = None) -> MedusaDrafter:
        """Heads from beside the target model `target`, on its device and dtype. Over a
        tensor-parallel rank 0, which holds a slice of the vocabulary, they project through
        the whole lm_head read from the target's files (one more [V, D] on that rank)."""
        p = next(target.parameters())
        heads, cfg = MedusaHeads.load(target_dir, p.dtype, p.device)
        tree = tree or cfg.get("tree") or CHAIN[: heads.num_heads]
        if getattr(target, "group", None) is None:
            return cls.for_target(heads, target, tree)
        lm_head = whole_lm_head(target_dir, target.shape.tie_embeddings).to(p.device, p.dtype)
        return cls(heads, lm_head, tree, getattr(target.backend, "supports_tree", False))

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> DraftOutput:
        t0 = time.perf_counter()
        # a row without a hidden state (no target pass since its last token) gets no drafts
        # this step; that step's pass gives it one
        live = [b for b, r in enumerate(requests) if r.k > 0 and r.hidden is not None]
        tokens: list[list[int]] = [[] for _ in requests]
        parents: list[list[int] | None] = [None for _ in requests]
        if live:
            h = torch.stack([requests[b].hidden for b in live])
            top = self.heads(h, self.lm_head).topk(self.topk, dim=-1).indices.tolist()
            for j, b in enumerate(live):
                paths = self.tree[: requests[b].k] if self.tree_ok else self.chain[: requests[b].k]
                tokens[b] = [top[j][len(p) - 1][p[-1]] for p in paths]
                parents[b] = self.parents[: len(paths)] if self.tree_ok else None
        hot = [one_hot(t) for t in tokens]
        return DraftOutput(tokens, [x[0] for x in hot], [x[1] for x in hot], time.perf_counter() - t0,
                           parents if self.tree_ok else None)
