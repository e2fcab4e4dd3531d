"""The Router: gRPC ingress behind Ray Serve's gRPC proxy.

It authenticates, validates and tokenizes, applies admission limits, hands the request to
a Verifier replica (Serve's request router picks which), and streams results back. Every
failure leaves as a gRPC status with a message; nothing it held is kept.
"""

from __future__ import annotations

import hmac
import logging
import os
import traceback
import uuid
from collections import Counter

import grpc
from ray import serve

from cluster.engine.sampling import InvalidRequest, SamplingParams
from cluster.engine.sequence import SpecParams
from cluster.proto import generation_pb2 as pb
from cluster.serve.stats import cluster_metrics
from cluster.serve.verifier import ErrorOutput, GenerateCall
from cluster.serve.wire import Undecodable

log = logging.getLogger(__name__)
MAX_REQUEST_ID = 128  # it becomes the sequence id and appears in logs
MODES = {pb.Speculation.UNSPECIFIED: "auto", pb.Speculation.AUTO: "auto", pb.Speculation.OFF: "off",
         pb.Speculation.FIXED: "fixed"}


class Status(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _short(value: str, n: int = 40) -> str:
    """A client's string echoed in a status: bounded, so a hostile one cannot blow the
    trailer size limit or fill the logs."""
    return repr(value) if len(value) <= n else repr(value[:n]) + f"... ({len(value)} chars)"


def _internal(e: Exception) -> Status:
    # an unexpected error: log its type and where, not its message (it may quote the prompt)
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    log.error("internal error in the router: %s at %s:%s", type(e).__name__,
              where.filename if where else "?", where.lineno if where else "?")
    return Status(grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__})")


def _api_keys(r) -> list[str]:
    """Keys from the config plus `api_keys_env`; a named variable that holds none is an
    error, not an open door."""
    keys = list(r.api_keys)
    if r.api_keys_env:
        extra = [k.strip() for k in os.environ.get(r.api_keys_env, "").split(",") if k.strip()]
        if not extra:
            raise RuntimeError(f"router.api_keys_env names {r.api_keys_env}, which holds no keys in this process")
        keys += extra
    return keys


def _finish(msg, spec: dict, timing: dict, reason: str):
    msg.finish_reason = reason
    msg.spec.CopyFrom(pb.SpecStats(**spec))
    msg.timing.CopyFrom(pb.Timing(**timing))


@serve.deployment(name="Router")
class Router:
    def __init__(self, config: dict, verifier, board=None):
        from cluster.config import ClusterConfig, resolve_model_path
        from cluster.engine.model import load_tokenizer

        self.cfg = ClusterConfig.model_validate(config)
        self.tokenizer = load_tokenizer(resolve_model_path(self.cfg.models.target))
        self.verifier, self.board = verifier, board
        self.api_keys = _api_keys(self.cfg.router)
        self.inflight = 0
        self.per_client: Counter[str] = Counter()
        self._info: dict | None = None
        ctx = serve.get_replica_context()
        self.router_id = ctx.replica_id.unique_id if ctx else "router"

    # ---- gRPC methods ------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        resp = pb.GenerateResponse()
        try:
            async for out in self._run(request, grpc_context):
                resp.text += out.text
                resp.token_ids.extend(out.token_ids)
                if out.finished:
                    _finish(resp, out.stats["spec"], out.stats["timing"], out.finish_reason)
                    resp.prompt_tokens = out.num_prompt
                    resp.replica = getattr(out, "replica", "")  # set by Verifier.generate
        except Status as e:
            self._set_status(grpc_context, e)
            return pb.GenerateResponse()
        except Exception as e:  # noqa: BLE001 - never a raw traceback to the client
            self._set_status(grpc_context, _internal(e))
            return pb.GenerateResponse()
        return resp

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context=None):
        try:
            async for out in self._run(request, grpc_context):
                chunk = pb.GenerateChunk(text=out.text, token_ids=out.token_ids, final=out.finished)
                if out.finished:
                    _finish(chunk, out.stats["spec"], out.stats["timing"], out.finish_reason)
                yield chunk
        except Exception as e:  # noqa: BLE001 - never a raw traceback to the client
            status = e if isinstance(e, Status) else _internal(e)
            self._set_status(grpc_context, status)
            # Serve ships the context with each yielded message, so a status set after the
            # last one (or with none) is lost; raising carries it (as gRPCStatusError). A
            # plain RuntimeError: the proxy must unpickle it without importing this module
            raise RuntimeError(status.message) from None

    async def GetModelInfo(self, request, grpc_context=None) -> pb.ModelInfo:
        i = await self._model_info()
        return pb.ModelInfo(target_model=i["target"], draft_model=i["draft"], vocab_size=i["vocab_size"],
                            max_model_len=i["max_model_len"], attention_backend=i["attention_backend"],
                            dtype=i["dtype"], block_size=i["block_size"], placement=i["placement"])

    async def GetStats(self, request, grpc_context=None) -> pb.Stats:
        snap = await self.board.snapshot.remote() if self.board else {"replicas": {}, "inflight": self.inflight}
        out = pb.Stats()
        fields = pb.ReplicaStats.DESCRIPTOR.fields_by_name
        for rid, s in sorted(snap["replicas"].items()):
            out.replicas.append(pb.ReplicaStats(**{k: v for k, v in s.items() if k in fields}))
        out.metrics.update(cluster_metrics(snap["replicas"], snap["inflight"]))
        return out

    def Check(self, request, grpc_context=None):
        from grpc_health.v1 import health_pb2

        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    # ---- the request path --------------------------------------------------------------
    async def _run(self, request: pb.GenerateRequest, grpc_context):
        client = self._authenticate(grpc_context)
        call = await self._validate(request)
        r = self.cfg.router
        if self.inflight >= r.max_inflight:
            raise Status(grpc.StatusCode.RESOURCE_EXHAUSTED, f"router at capacity ({r.max_inflight} requests in flight)")
        if self.per_client[client] >= r.per_client_concurrency:
            raise Status(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"client concurrency limit reached ({r.per_client_concurrency})")
        self.inflight += 1
        self.per_client[client] += 1
        self._report_inflight()
        gen = self.verifier.options(stream=True).generate.remote(call)
        done = False
        try:
            async for out in gen:
                if isinstance(out, ErrorOutput):
                    raise Status(getattr(grpc.StatusCode, out.code), out.message)
                done = out.finished
                yield out
        except Status:
            raise
        except Exception as e:  # the replica died or the call broke: the client may retry
            log.warning("verifier call failed: %s", e)
            raise Status(grpc.StatusCode.UNAVAILABLE, f"verifier unavailable: {type(e).__name__}") from None
        finally:
            if not done:
                gen.cancel()  # the client left or the call failed: the verifier frees the sequence
            self.inflight -= 1
            self.per_client[client] -= 1
            if not self.per_client[client]:
                del self.per_client[client]
            self._report_inflight()

    def _authenticate(self, grpc_context) -> str:
        keys = self.api_keys
        meta = dict(grpc_context.invocation_metadata()) if grpc_context is not None else {}
        if not keys:  # per client host ("ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7"), not per connection
            peer = grpc_context.peer() if grpc_context is not None else ""
            return peer.rpartition(":")[0] or "anonymous"
        token = meta.get("authorization", "")
        token = token[7:] if token[:7].lower() == "bearer " else ""  # the scheme is case-insensitive
        # compare against every key so the time taken does not reveal which one nearly matched
        ok = [hmac.compare_digest(token.encode(), k.encode()) for k in keys]
        if not token or not any(ok):
            raise Status(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (authorization: Bearer <key>)")
        return f"key-{ok.index(True)}"

    async def _validate(self, req: pb.GenerateRequest) -> GenerateCall:
        r = self.cfg.router
        bad = lambda msg: Status(grpc.StatusCode.INVALID_ARGUMENT, msg)  # noqa: E731
        if isinstance(req, Undecodable):  # see cluster.serve.wire
            raise bad(f"request does not parse: {req.error}")
        if req.model and req.model not in (self.cfg.models.target, "default"):
            raise Status(grpc.StatusCode.NOT_FOUND, f"unknown model {_short(req.model)}; this cluster serves "
                                                    f"{self.cfg.models.target!r}")
        if not req.prompt:
            raise bad("prompt is empty")
        if len(req.prompt) > r.max_prompt_chars:
            raise bad(f"prompt has {len(req.prompt)} characters; the limit is {r.max_prompt_chars}")
        max_tokens = req.max_tokens or r.default_max_tokens
        if not 1 <= max_tokens <= r.max_tokens_limit:
            raise bad(f"max_tokens must be in [1, {r.max_tokens_limit}], got {req.max_tokens}")
        if req.speculation.mode not in MODES:
            raise bad(f"unknown speculation mode {req.speculation.mode} (AUTO, OFF or FIXED)")
        if len(req.request_id) > MAX_REQUEST_ID:
            raise bad(f"request_id has {len(req.request_id)} characters; the limit is {MAX_REQUEST_ID}")
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature if req.HasField("temperature") else 0.0,
            top_p=req.top_p if req.HasField("top_p") else 1.0,
            top_k=req.top_k if req.HasField("top_k") else 0,
            seed=req.seed if req.HasField("seed") else None,
            stop=list(req.stop))
        spec = SpecParams(MODES[req.speculation.mode], req.speculation.gamma)
        try:
            params.validate()
            if spec.mode == "fixed" and not 0 <= spec.gamma <= self.cfg.speculation.gamma_max:
                raise InvalidRequest(f"speculation gamma must be in [0, {self.cfg.speculation.gamma_max}], "
                                     f"got {spec.gamma}")
            if req.drafter and req.drafter not in ("model", "ngram", "medusa"):
                raise InvalidRequest(f"unknown drafter {_short(req.drafter)} (model, ngram or medusa)")
        except InvalidRequest as e:
            raise bad(str(e)) from None
        ids = self.tokenizer.encode(req.prompt)
        try:
            limit = (await self._model_info())["max_model_len"]
        except Exception as e:  # noqa: BLE001 - no verifier answered yet
            raise Status(grpc.StatusCode.UNAVAILABLE, f"verifier unavailable: {type(e).__name__}") from None
        if len(ids) >= limit:
            raise bad(f"prompt has {len(ids)} tokens; the limit is {limit - 1}")
        rid = f"{req.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
        return GenerateCall(ids, params, spec, req.drafter or None, rid)

    async def _model_info(self) -> dict:
        if self._info is None:
            self._info = await self.verifier.model_info.remote()
        return self._info

    def _report_inflight(self) -> None:
        if self.board is not None:
            self.board.router_inflight.remote(self.router_id, self.inflight)

    @staticmethod
    def _set_status(grpc_context, e: Status) -> None:
        if grpc_context is not None:
            grpc_context.set_code(e.code)
            grpc_context.set_details(e.message)
