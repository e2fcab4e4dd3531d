"""Admission: what every ingress does before a request leaves for a verifier.

API keys, the per-client and per-router limits, validation and tokenization, in no
protocol's terms: an ingress decodes its request into a `GenerateInput`, hands over the
bearer token and the peer it saw, and maps an `AdmissionError`'s kind onto its own status
codes. This is a served request's only check: what it asks of the engine is checked with the
engine's own functions (cluster.engine.requests: the parameters before tokenizing, the
prompt after), so the edge and the engine cannot disagree, and the verifier trusts it. The
checks only an edge makes come first: text length before tokenizing, the max_tokens policy,
request ids, and which model this cluster serves.
"""

from __future__ import annotations

import hmac
import os
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.engine.requests import RequestLimits, validate_drafter, validate_params, validate_prompt
from cluster.engine.sampling import InvalidRequest, SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.serve.calls import ErrorKind, GenerateCall, RequestError

if TYPE_CHECKING:
    from cluster.config import ClusterConfig, RouterSection

MAX_REQUEST_ID = 128  # it becomes the sequence id and appears in logs
NO_KEY = "missing or invalid API key (authorization: Bearer <key>)"


class AdmissionError(RequestError):
    """A request refused at the ingress: `kind` says why, `message` what to fix."""


def _invalid(message: str) -> AdmissionError:
    return AdmissionError(ErrorKind.INVALID, message)


@dataclass
class GenerateInput:
    """One generate request as an ingress decoded it. None, 0 and "" mean the server's
    default, so an ingress passes on only what its client set."""
    prompt: str
    max_tokens: int = 0                # 0: router.default_max_tokens
    temperature: float | None = None   # None: 0 (greedy)
    top_p: float | None = None         # None: 1
    top_k: int | None = None           # None: 0 (off)
    seed: int | None = None            # None: a random one
    stop: list[str] = field(default_factory=list)
    spec_mode: str = "auto"            # auto, off or fixed; an ingress passes others on to be refused
    gamma: int = 0                     # read only when spec_mode is fixed
    drafter: str = ""                  # "": the deployment's default
    model: str = ""                    # "" or "default": the model this cluster serves
    request_id: str = ""               # "": "req"; a unique suffix is added either way
    logprobs: int | None = None        # alternatives per token (0..5); None: no log-probabilities


def short(value: str, n: int = 40) -> str:
    """A client's string echoed in an error: bounded, so a hostile one cannot blow a
    protocol's size limit for error details or fill the logs."""
    return repr(value) if len(value) <= n else repr(value[:n]) + f"... ({len(value)} chars)"


def api_keys(r: RouterSection) -> list[str]:
    """Keys from the config plus `api_keys_env`; a named variable that holds none is an
    error, not an open door."""
    keys = list(r.api_keys)
    if r.api_keys_env:
        extra = [k.strip() for k in os.environ.get(r.api_keys_env, "").split(",") if k.strip()]
        if not extra:
            raise RuntimeError(f"router.api_keys_env names {r.api_keys_env}, which holds no keys in this process")
        keys += extra
    return keys


def bearer_token(authorization: str | None) -> str | None:
    """The key of an `authorization: Bearer <key>` header (gRPC metadata or HTTP); None
    for no header or another scheme. The scheme is case-insensitive."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:]
    return None


class Admission:
    """One per ingress replica: its API keys, its in-flight counts, and the tokenizer.

    `model_info` is an async callable returning a verifier's `model_info()` (it should
    cache: every admitted request awaits it).
    """

    def __init__(self, cfg: ClusterConfig, tokenizer, model_info: Callable[[], Awaitable[dict]]):
        self.settings = cfg.router
        self.model = cfg.models.target
        self.gamma_max = cfg.speculation.gamma_max
        self.tokenizer, self.model_info = tokenizer, model_info
        self.api_keys = api_keys(cfg.router)
        self.inflight = 0
        self.per_client: Counter[str] = Counter()
        # a client's share in each router replica: the shares never add up past the limit,
        # and Serve's proxies spread a client's requests over the replicas by their load
        self.client_limit = max(1, cfg.router.per_client_concurrency // cfg.router.num_replicas)

    def authenticate(self, token: str | None, peer: str) -> str:
        """The client a request counts against: `key-<i>` for the i-th API key or, when no
        keys are set, the peer's host ("ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7"): per
        client host, not per connection."""
        if not self.api_keys:
            return peer.rpartition(":")[0] or "anonymous"
        token = token or ""
        # compare against every key so the time taken does not reveal which one nearly matched
        ok = [hmac.compare_digest(token.encode(), k.encode()) for k in self.api_keys]
        if not token or not any(ok):
            raise AdmissionError(ErrorKind.UNAUTHENTICATED, NO_KEY)
        return f"key-{ok.index(True)}"

    async def admit(self, inp: GenerateInput) -> GenerateCall:
        """Validate and tokenize: the call to send a verifier, or AdmissionError naming the
        first problem (checks that need no tokenizing or verifier come first)."""
        r = self.settings
        if inp.model and inp.model not in (self.model, "default"):
            raise AdmissionError(ErrorKind.NOT_FOUND, f"unknown model {short(inp.model)}; this cluster serves "
                                                      f"{self.model!r}")
        if not inp.prompt:  # as text too: a tokenizer that adds BOS makes "" one token
            raise _invalid("prompt is empty")
        if len(inp.prompt) > r.max_prompt_chars:  # before the tokenizer spends time on it
            raise _invalid(f"prompt has {len(inp.prompt)} characters; the limit is {r.max_prompt_chars}")
        max_tokens = inp.max_tokens or r.default_max_tokens
        if not 1 <= max_tokens <= r.max_tokens_limit:
            raise _invalid(f"max_tokens must be in [1, {r.max_tokens_limit}], got {inp.max_tokens}")
        if len(inp.request_id) > MAX_REQUEST_ID:
            raise _invalid(f"request_id has {len(inp.request_id)} characters; the limit is {MAX_REQUEST_ID}")
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if inp.temperature is None else inp.temperature,
            top_p=1.0 if inp.top_p is None else inp.top_p,
            top_k=0 if inp.top_k is None else inp.top_k,
            seed=inp.seed,
            stop=list(inp.stop),
            logprobs=inp.logprobs)
        spec = SpecParams(inp.spec_mode, inp.gamma)
        drafter = inp.drafter or None
        try:
            validate_params(params, spec, self.gamma_max)
        except InvalidRequest as e:
            raise _invalid(str(e)) from None
        ids = self.tokenizer.encode(inp.prompt)
        try:
            info = await self.model_info()
        except Exception as e:  # noqa: BLE001 - no verifier answered yet
            raise AdmissionError(ErrorKind.UNAVAILABLE, f"verifier unavailable: {type(e).__name__}") from None
        # vocab_size stays None: the ids come from the target's own tokenizer. A verifier
        # that does not list its drafters leaves them to the registry (and its own check)
        drafters = info.get("drafters")
        limits = RequestLimits(max_model_len=info["max_model_len"], gamma_max=self.gamma_max,
                               drafters=None if drafters is None else tuple(drafters))
        try:
            validate_drafter(drafter, limits.drafters)
            validate_prompt(ids, limits)
        except InvalidRequest as e:
            raise _invalid(str(e)) from None
        return GenerateCall(ids, params, spec, drafter, f"{inp.request_id or 'req'}-{uuid.uuid4().hex[:12]}")

    @contextmanager
    def slot(self, client: str) -> Iterator[None]:
        """Hold one of the router's in-flight places and one of `client`'s for the body;
        EXHAUSTED at once when either is full (a client retries; nothing queues here). Both
        are given back however the body ends."""
        r = self.settings
        if self.inflight >= r.max_inflight:
            raise AdmissionError(ErrorKind.EXHAUSTED, f"router at capacity ({r.max_inflight} requests in flight)")
        if self.per_client[client] >= self.client_limit:
            raise AdmissionError(ErrorKind.EXHAUSTED, f"client concurrency limit reached ({r.per_client_concurrency}"
                                 + (f", {self.client_limit} in each of {r.num_replicas} routers)"
                                    if r.num_replicas > 1 else ")"))
        self.inflight += 1
        self.per_client[client] += 1
        try:
            yield
        finally:
            self.inflight -= 1
            self.per_client[client] -= 1
            if not self.per_client[client]:
                del self.per_client[client]  # one entry per client ever seen would only grow
