"""The engine's configuration: one class, one set of defaults, documented once.

It is also the cluster config's `engine:` section (cluster.config). The last five fields
come from other sections there (`models.device`, `models.dtype`, `models.attention`,
`speculation.gamma`, `speculation.gamma_max`), so they are not written under `engine:`
and do not appear in its dump.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    max_num_seqs: int = Field(32, ge=1)
    """Sequences decoding at once per verifier replica (a scheduling limit: KV is paged)."""
    max_model_len: int = Field(1024, ge=16)
    """Prompt plus output tokens per sequence; costs nothing until a sequence uses it."""
    max_waiting: int = Field(64, ge=0)
    """Bounded admission queue per replica: requests beyond max_num_seqs running and this many
    waiting get RESOURCE_EXHAUSTED."""
    max_batch_tokens: int = Field(512, ge=1)
    """Verify-token budget of one step: sum of gamma+1 over rows plus prefill tokens."""
    prefill_chunk: int = Field(256, ge=1)
    """Prompt tokens per sequence per step (chunked prefill)."""
    block_size: int = Field(16, ge=1)
    """Tokens per KV block: the unit of the paged cache, the block hash and the KV directory."""
    kv_cache_gb: float | None = Field(None, gt=0)
    """KV pool size in GiB; null: from memory on a GPU (gpu_memory_utilization), or room for
    max_num_seqs sequences of max_model_len tokens on a CPU."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of the GPU the verifier may fill; the KV pool gets what weights, a colocated
    drafter, the widest step's activations and the CUDA graphs leave of it."""
    prefix_caching: bool = True
    """Share full prompt blocks between sequences (zero-copy, by block hash) and keep freed
    ones cached until their blocks are needed (LRU)."""
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """KV cache element type: auto (the model's dtype) or fp8 (e4m3 with per-layer scales
    calibrated at start-up, the same on every tensor-parallel rank; on FA3 attention itself
    runs in fp8). Half the cache bytes; accuracy in benchmarks/gpu/h100/fp8."""
    compile: bool = False
    """GPU fast path: Triton GEMV with fused norm/SiLU/residual for batch-1 steps and
    torch.compile'd elementwise kernels (CUDA only; ignored on CPU). Costs warm-up time."""
    cuda_graphs: bool = True
    """Capture decode, verify and prefill steps as CUDA graphs (CUDA only; attention backends
    that read lengths from tensors: triton, fa3)."""
    compile_cache_dir: str | None = "~/.cache/spec-cluster/compile"
    """Where compiled Triton kernels, their autotuning results and torch.compile's artifacts are
    kept between starts, so a replica that scales up loads them instead of compiling (the k8s
    overlays mount it from a volume). null: the libraries' own places, without tuning results."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks (GPUs of one node) a verifier's target is split over: heads, MLP features and the
    vocabulary (cluster.engine.worker.sharding). Attention heads must divide by it, and KV heads
    divide by it or it by them. 1: one process, no collectives."""
    tp_one_shot_kb: int = Field(512, ge=0)
    """Under tensor parallelism on CUDA, all-reduces up to this many KB (decode and verify
    passes of a few rows) run as one-shot kernels over symmetric memory
    (torch.distributed._symmetric_memory: each rank reads its peers' buffers over NVLink), the
    rest through NCCL; vLLM and SGLang use such a custom all-reduce for the same small messages.
    0: NCCL for all."""
    draft_look_ahead: bool = True
    """A model drafter on a GPU drafts the next step while the target verifies, guessing
    every draft is accepted; a right guess saves that step's drafting. Remote drafters look
    ahead while the waits their hits save outweigh the waits their misses cost
    (cluster/engine/spec/drafting.py). false turns both off."""
    spec_ahead: bool = True
    """Speculative steps with a model drafter on CUDA graphs run a step ahead: step n+1 drafts
    and verifies on the GPU from step n's results there while the host reads step n's tokens
    (cluster.engine.spec.ahead; not for rows that ask for logprobs). Greedy tokens, and a
    seed's, are the same either way; false: every speculative step waits for the host."""
    mixed_prefill: bool = False
    """Run prompts' prefill chunks in the same pass as the decoding rows' verify rows, each
    padded to its own width (Runner.forward_mixed), instead of a prefill step during
    which every decoding sequence waits. The verify rows take the step's token budget first,
    the chunks what is left. Such a pass runs eager (no CUDA graph), and a tensor-parallel
    target keeps separate steps. Off by default: what it does to speed on a GPU has not been
    measured yet (only on CPU, benchmarks/engine_cpu)."""

    device: str = Field("cpu", exclude=True)
    """Set from models.device: cpu or cuda."""
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", exclude=True)
    """Set from models.dtype: weights and activations."""
    attention: str = Field("auto", exclude=True)
    """Set from models.attention: a backend of cluster.engine.worker.attention.BACKENDS."""
    gamma: int = Field(4, ge=0, exclude=True)
    """Set from speculation.gamma: draft tokens for 'auto' requests when no controller is set."""
    gamma_max: int = Field(8, ge=0, exclude=True)
    """Set from speculation.gamma_max: the longest draft a step verifies (sizes graphs and slots)."""

    @model_validator(mode="after")
    def _consistent(self):
        if self.gamma > self.gamma_max:
            raise ValueError(f"gamma ({self.gamma}) must be <= gamma_max ({self.gamma_max})")
        if self.max_batch_tokens < self.gamma_max + 1:
            raise ValueError("max_batch_tokens must hold one row of gamma_max + 1 tokens")
        return self

    @property
    def draft_stream(self) -> bool:
        """Whether a draft model drafts on a CUDA stream of its own (beside the verify pass).
        Not beside a tensor-parallel target's CUDA graphs: there each new request's first
        draft call waited ~68 s (benchmarks/gpu/tp/README.md)."""
        return self.tensor_parallel_size == 1 or not self.cuda_graphs


DERIVED = ("device", "dtype", "attention", "gamma", "gamma_max")
