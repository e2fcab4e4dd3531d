"""Builds engines and drafters from a ClusterConfig (shared by local mode and deployments)."""

from __future__ import annotations

from cluster.config import ClusterConfig, resolve_model_path
from cluster.engine.drafter import Drafter, ModelDrafter, NgramDrafter
from cluster.engine.engine import DTYPES, Engine
from cluster.engine.medusa import HEADS_FILE, MedusaDrafter, has_heads
from cluster.engine.model import compile_kernels, load_model, load_tokenizer


def build_model_drafter(cfg: ClusterConfig) -> ModelDrafter:
    ec = cfg.engine_config()
    model = load_model(resolve_model_path(cfg.models.draft), DTYPES[ec.dtype], ec.device)
    cuda = next(model.parameters()).is_cuda  # as the target's engine does (colocated)
    if cuda and ec.compile:
        compile_kernels()
    drafter = ModelDrafter(model, num_slots=2 * ec.max_num_seqs, max_len=ec.max_model_len, gamma_max=ec.gamma_max,
                           look_ahead="auto" if ec.draft_look_ahead else None)
    if cuda:
        drafter.runner.warm_up()  # kernel variants and CUDA graphs now, not in the middle of a step
    return drafter


def build_engine(cfg: ClusterConfig, remote_drafter: Drafter | None = None) -> Engine:
    """The target engine with an n-gram drafter always, and the model drafter either
    in-process (colocated) or as `remote_drafter` (disaggregated)."""
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
    if has_heads(target):  # Medusa runs in the verifier: it reads the engine's hidden states
        engine.drafters["medusa"] = MedusaDrafter.load(engine, target)
    engine.controller = make_controller(cfg.speculation)
    return engine
