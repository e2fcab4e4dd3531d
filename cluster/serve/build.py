"""Builds engines and drafters from a ClusterConfig (shared by local mode and deployments).

Every drafter the registry (cluster.engine.drafters.registry) names is built here when the
config makes it possible: n-gram and early exit always, the draft model when models.draft is
set (in this process, or `remote_drafter` in its own replicas), Medusa when heads lie beside
the target.
"""

from __future__ import annotations

from cluster.config import ClusterConfig, resolve_model_path
from cluster.engine.drafters.base import Drafter
from cluster.engine.drafters.early_exit import EarlyExitDrafter
from cluster.engine.drafters.medusa import HEADS_FILE, MedusaDrafter, has_heads
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.drafters.ngram import NgramDrafter
from cluster.engine.drafters.registry import DRAFTERS
from cluster.engine.engine import DTYPES, Engine
from cluster.engine.loader import load_model, load_tokenizer
from cluster.engine.model import compile_kernels


def build_model_drafter(cfg: ClusterConfig) -> ModelDrafter:
    ec = cfg.engine_config()
    model = load_model(resolve_model_path(cfg.models.draft), DTYPES[ec.dtype], ec.device)
    cuda = next(model.parameters()).is_cuda  # as the target's engine does (colocated)
    if cuda and ec.compile:
        compile_kernels()
    drafter = ModelDrafter(model, num_slots=2 * ec.max_num_seqs, max_len=ec.max_model_len,
                           look_ahead="auto" if ec.draft_look_ahead else None)
    if cuda:
        drafter.runner.warm_up()  # kernel variants and CUDA graphs now, not in the middle of a step
    return drafter


def build_engine(cfg: ClusterConfig, remote_drafter: Drafter | None = None) -> Engine:
    """The target engine and every drafter the config allows (see the module docstring)."""
    from cluster.policy.controller import make_controller

    ec = cfg.engine_config()
    target = resolve_model_path(cfg.models.target)
    model = load_model(target, DTYPES[ec.dtype], ec.device)
    drafters: dict[str, Drafter] = {"ngram": NgramDrafter()}
    if cfg.models.draft:
        drafters["model"] = remote_drafter or build_model_drafter(cfg)
    default = None if cfg.models.drafter == "none" else cfg.models.drafter
    if default == "medusa" and not has_heads(target):
        raise ValueError(f"drafter 'medusa' needs {HEADS_FILE} in {target} (spec-cluster models train-medusa)")
    engine = Engine(model, load_tokenizer(target), ec, drafters, default, identity=cfg.models.target)
    # these two read the target's own state (hidden states, KV), so they live in its process
    engine.drafters["early-exit"] = EarlyExitDrafter(engine.runner, cfg.models.early_exit_layers
                                                     or max(1, model.shape.layers // 4))
    if has_heads(target):
        engine.drafters["medusa"] = MedusaDrafter.load(target, model)
    assert set(engine.drafters) <= set(DRAFTERS), "every drafter is in the registry"
    engine.controller = make_controller(cfg.speculation)
    return engine
