"""Builds engines and drafters from a ClusterConfig (shared by local mode and deployments).

Every drafter the registry (cluster.engine.drafters.registry) names is built here when the
config makes it possible: n-gram and early exit always, the draft model when models.draft is
set and EAGLE-3 when a head is configured or lies beside the target (in this process, or
`remote` ones in their own replicas), Medusa when heads lie beside the target.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from cluster.config import ClusterConfig, resolve_model_path
from cluster.engine.distributed.ranks import start_ranks
from cluster.engine.drafters.base import Drafter
from cluster.engine.drafters.eagle3 import Eagle3Drafter
from cluster.engine.drafters.eagle3_embed import embedded_aux_layers, is_embedded, load_embedded_head
from cluster.engine.drafters.eagle3_load import CONFIG as EAGLE3_CONFIG
from cluster.engine.drafters.eagle3_load import head_config, load_head, target_embedding
from cluster.engine.drafters.early_exit import EarlyExitDrafter
from cluster.engine.drafters.medusa import HEADS_FILE, MedusaDrafter, has_heads
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.drafters.ngram import NgramDrafter
from cluster.engine.drafters.registry import DRAFTERS
from cluster.engine.engine import Engine
from cluster.engine.worker.loader import DTYPES, load_model, load_tokenizer
from cluster.engine.worker.model import CausalLM, compile_kernels


log = logging.getLogger(__name__)
# Longest sequence (prompt + output + drafts) the draft model drafts for; longer rows decode
# without its drafts. See build_model_drafter.
DRAFT_MAX_LEN = 2048
EAGLE3_DIR = "eagle3"  # a head trained here lies beside its target, in this subdirectory


def eagle3_dir(cfg: ClusterConfig) -> str | None:
    """The EAGLE-3 head to use: models.eagle3, else `<target>/eagle3` where it exists."""
    if cfg.models.eagle3:
        return resolve_model_path(cfg.models.eagle3)
    beside = Path(resolve_model_path(cfg.models.target)) / EAGLE3_DIR
    return str(beside) if (beside / EAGLE3_CONFIG).is_file() else None


def remote_drafters(cfg: ClusterConfig) -> list[str]:
    """The drafters a Drafter replica hosts under this config (disaggregated placement)."""
    return (["model"] if cfg.models.draft else []) + (["eagle3"] if eagle3_dir(cfg) else [])


def build_eagle3_drafter(cfg: ClusterConfig, target: CausalLM | None = None) -> Eagle3Drafter:
    """The EAGLE-3 head over `target` (sharing its embedding), or, in a drafter replica
    (target None) or over a tensor-parallel rank 0, with the target's whole embedding read
    from its files."""
    from cluster.engine.worker.loader import load_model

    ec = cfg.engine_config()
    path, target_dir = eagle3_dir(cfg), resolve_model_path(cfg.models.target)
    if path is None:
        raise ValueError(f"drafter 'eagle3' needs models.eagle3 or a head in {target_dir}/{EAGLE3_DIR} "
                         "(spec-cluster models train-eagle3)")
    dtype = DTYPES[ec.dtype]
    if target is not None and target.group is not None:  # a tensor-parallel rank holds a slice of the vocabulary
        target = None
    if target is None and (Path(target_dir) / "embed.json").is_file():  # an embedded demo: build it
        target = load_model(target_dir, dtype, "cpu")
    if target is not None:
        layers, vocab, embed = target.shape.layers, target.shape.vocab_size, target.embed_tokens.weight
    else:
        from transformers import AutoConfig

        tc = AutoConfig.from_pretrained(target_dir)
        layers, vocab, embed = tc.num_hidden_layers, tc.vocab_size, target_embedding(target_dir, dtype)
    # positions: the draft model's cap (DRAFT_MAX_LEN) plus a verify row's drafts
    max_len = min(ec.max_model_len, DRAFT_MAX_LEN) + ec.gamma_max + 1
    if is_embedded(path):  # a trained small head in a larger head's shape (cluster.engine.drafters.eagle3_embed)
        head = load_embedded_head(path, embed.to(ec.device), layers, max_positions=max_len + 1)
    else:
        head = load_head(path, layers, dtype, ec.device, embed.to(ec.device), vocab, max_positions=max_len + 1)
    cuda = next(head.parameters()).is_cuda
    if cuda and ec.compile:
        compile_kernels(ec.compile_cache_dir)
    return Eagle3Drafter(head, num_slots=draft_slots(ec), max_len=max_len, attention=ec.attention,
                         cuda_graphs=ec.cuda_graphs, graph_width=ec.gamma_max + 1)


def eagle3_aux_layers(cfg: ClusterConfig, target_layers: int) -> tuple[int, ...]:
    """Which target layers a remote EAGLE-3 head reads (its config only, no weights)."""
    path = eagle3_dir(cfg)
    return embedded_aux_layers(path, target_layers) if is_embedded(path) else head_config(path, target_layers)[0].aux_layers


def draft_slots(ec) -> int:
    """Sequences a drafter keeps state for: two verifiers' full batches (a verifier keeps one
    drafter replica for 30 s, state it left expires after drafter_state_ttl_s) before LRU
    eviction makes a row catch up again from the start."""
    return 2 * ec.max_num_seqs


def build_model_drafter(cfg: ClusterConfig) -> ModelDrafter:
    ec = cfg.engine_config()
    model = load_model(resolve_model_path(cfg.models.draft), DTYPES[ec.dtype], ec.device)
    cuda = next(model.parameters()).is_cuda  # as the target's engine does (colocated)
    if cuda and ec.compile:
        compile_kernels(ec.compile_cache_dir)
    # ModelDrafter's paged pool is num_slots x (max_len + 512) tokens, allocated up front.
    # Length: capped at DRAFT_MAX_LEN, since with the target's max_model_len the pool would
    # be rows x max_model_len, which a long-context target makes absurd (Llama-3.2-1B, 32 KiB
    # a token: 512 rows x 32k = 520 GiB, x 2.5k = 40 GiB). The drafter skips rows longer than
    # max_len (ModelDrafter.propose), so the cap costs speculation on the tokens past 2048 of
    # long sequences only; short and medium ones, where most tokens are, draft as before. The
    # demo and test configs (max_model_len <= 1024) are unchanged by it. Colocated on a GPU,
    # the target's KV pool is sized after this one exists (cluster.engine.worker.memory), so it
    # comes out of the verifier's pool.
    return ModelDrafter(model, num_slots=draft_slots(ec), max_len=min(ec.max_model_len, DRAFT_MAX_LEN),
                        look_ahead="auto" if ec.draft_look_ahead else None,
                        own_stream=ec.draft_stream, max_draft=ec.gamma_max + 1)


def build_engine(cfg: ClusterConfig, remote: Drafter | dict[str, Drafter] | None = None,
                 start=start_ranks) -> Engine:
    """The target engine and every drafter the config allows (see the module docstring);
    `remote`: drafters in Drafter replicas (by name), built here for the others; `start`:
    how tensor-parallel ranks start (child processes; a Verifier replica passes
    cluster.serve.followers.start_followers)."""
    from cluster.policy.controller import make_controller

    t0 = time.perf_counter()
    ec = cfg.engine_config()
    remote = {remote.name: remote} if isinstance(remote, Drafter) else dict(remote or {})
    target = resolve_model_path(cfg.models.target)
    # tensor-parallel: this process is rank 0 and starts the others (cluster.engine.distributed.ranks)
    group = start(str(target), ec) if ec.tensor_parallel_size > 1 else None
    model = load_model(target, DTYPES[ec.dtype], ec.device if group is None else group.device, group)
    drafters: dict[str, Drafter] = {"ngram": NgramDrafter()}
    if cfg.models.draft:
        drafters["model"] = remote.get("model") or build_model_drafter(cfg)
    if eagle3_dir(cfg):  # under tensor parallelism rank 0 captures the aux states (cluster.engine.distributed.ranks)
        if "eagle3" in remote:  # its aux layers decide what the target's passes capture
            remote["eagle3"].aux_layers = eagle3_aux_layers(cfg, model.shape.layers)
        drafters["eagle3"] = remote.get("eagle3") or build_eagle3_drafter(cfg, model)
    default = None if cfg.models.drafter == "none" else cfg.models.drafter
    if default == "medusa" and not has_heads(target):
        raise ValueError(f"drafter 'medusa' needs {HEADS_FILE} in {target} (spec-cluster models train-medusa)")
    if default == "medusa" and group is not None and (Path(target) / "embed.json").is_file():
        raise ValueError("drafter 'medusa' over an embedded target is not supported with tensor_parallel_size > 1")
    if default == "eagle3" and "eagle3" not in drafters:
        raise ValueError(f"drafter 'eagle3' needs models.eagle3 or a head in {target}/{EAGLE3_DIR} "
                         "(spec-cluster models train-eagle3)")
    tok, loaded = load_tokenizer(target), time.perf_counter() - t0
    engine = Engine(model, tok, ec, drafters, default, identity=cfg.models.target)
    engine.startup = {"load_s": loaded, **engine.startup, "total_s": time.perf_counter() - t0}
    log.info("engine up in %.1f s (%s)", engine.startup["total_s"],
             ", ".join(f"{k} {v:.1f}" for k, v in engine.startup.items() if k != "total_s"))
    # these two read the target's own state (hidden states, KV), so they live in its process
    engine.drafters["early-exit"] = EarlyExitDrafter(engine.runner, cfg.models.early_exit_layers
                                                     or max(1, model.shape.layers // 4))
    # Medusa projects through the whole LM head: under tensor parallelism rank 0 reads it from
    # the files (MedusaDrafter.load), which an embedded target has none of
    if has_heads(target) and (group is None or not (Path(target) / "embed.json").is_file()):
        engine.drafters["medusa"] = MedusaDrafter.load(target, model)
    assert set(engine.drafters) <= set(DRAFTERS), "every drafter is in the registry"
    engine.controller = make_controller(cfg.speculation)
    return engine
