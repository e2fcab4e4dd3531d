"""The Router: the ingress behind Ray Serve's gRPC proxy and, through the OpenAI-compatible
routes it mixes in (cluster/serve/openai_api.py), its HTTP proxy.

It decodes each request into admission's protocol-neutral input (`cluster.serve.admission`
authenticates, validates, tokenizes and applies the limits), hands the call to a Verifier
replica (Serve's request router picks which), and streams results back. Every failure
leaves as a gRPC status with a message, through one table from `ErrorKind`; nothing it held
is kept.
"""

from __future__ import annotations

import logging
from contextlib import aclosing
from dataclasses import replace

import grpc
from ray import serve

from cluster.proto import generation_pb2 as pb
from cluster.serve.admission import Admission, AdmissionError, GenerateInput, bearer_token
from cluster.serve.calls import ErrorKind, RequestError, internal_error, stream_outputs
from cluster.serve.openai_api import OpenAIRoutes, api
from cluster.serve.stats import KEEP_S, BoardView, cluster_metrics
from cluster.serve.wire import Undecodable

log = logging.getLogger(__name__)
MODES = {pb.Speculation.UNSPECIFIED: "auto", pb.Speculation.AUTO: "auto", pb.Speculation.OFF: "off",
         pb.Speculation.FIXED: "fixed"}
CODES = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


def _decode(req: pb.GenerateRequest) -> GenerateInput:
    """The proto request in admission's terms; an unset optional field stays None (the
    server's default). An unknown speculation enum value is passed on as its number, for
    admission to refuse in its place among the checks."""
    def opt(name: str):
        return getattr(req, name) if req.HasField(name) else None

    mode = req.speculation.mode
    return GenerateInput(
        prompt=req.prompt, max_tokens=req.max_tokens, temperature=opt("temperature"), top_p=opt("top_p"),
        top_k=opt("top_k"), seed=opt("seed"), stop=list(req.stop), spec_mode=MODES.get(mode, str(mode)),
        gamma=req.speculation.gamma, drafter=req.drafter, model=req.model, request_id=req.request_id,
        logprobs=opt("logprobs"))


def _logprobs(out) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in lp.top])
            for lp in out.logprobs or ()]


def _finish(msg, out) -> None:
    """What a response and a stream's final chunk both carry from the request's last output."""
    msg.finish_reason = out.finish_reason
    msg.spec.CopyFrom(pb.SpecStats(**out.stats["spec"]))
    msg.timing.CopyFrom(pb.Timing(**out.stats["timing"]))
    msg.prompt_tokens, msg.cached_tokens = out.num_prompt, out.stats.get("cached_tokens", 0)
    msg.replica = getattr(out, "replica", "")  # set by Verifier.generate


def _set_status(grpc_context, e: RequestError) -> None:
    if grpc_context is not None:
        grpc_context.set_code(CODES[e.kind])
        grpc_context.set_details(e.message)


@serve.deployment(name="Router")
@serve.ingress(api)  # an application has one ingress, so HTTP routes live here too
class Router(OpenAIRoutes):
    def __init__(self, config: dict, verifier, board=None):
        from cluster.config import ClusterConfig, resolve_model_path
        from cluster.engine.worker.loader import load_tokenizer

        self.cfg = ClusterConfig.model_validate(config)
        self.verifier, self.board = verifier, board
        self._info: dict | None = None
        ctx = serve.get_replica_context()
        self.router_id = ctx.replica_id.unique_id if ctx else "router"
        tokenizer = load_tokenizer(resolve_model_path(self.cfg.models.target))
        self.admission = Admission(self.cfg, tokenizer, self._model_info)
        self.view = BoardView(board, self.router_id, lambda: self.admission.inflight) if board else None

    # ---- gRPC methods ------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        resp = pb.GenerateResponse()
        try:
            async with aclosing(self._run(request, grpc_context, stream=False)) as outs:
                async for out in outs:
                    resp.text += out.text
                    resp.token_ids.extend(out.token_ids)
                    resp.logprobs.extend(_logprobs(out))
                    if out.finished:
                        _finish(resp, out)
        except Exception as e:  # noqa: BLE001 - never a raw traceback to the client
            _set_status(grpc_context, e if isinstance(e, RequestError) else internal_error(e, "router"))
            return pb.GenerateResponse()
        return resp

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context=None):
        try:
            async with aclosing(self._run(request, grpc_context)) as outs:
                async for out in outs:
                    chunk = pb.GenerateChunk(text=out.text, token_ids=out.token_ids, final=out.finished,
                                             logprobs=_logprobs(out))
                    if out.finished:
                        _finish(chunk, out)
                    yield chunk
        except Exception as e:  # noqa: BLE001 - never a raw traceback to the client
            error = e if isinstance(e, RequestError) else internal_error(e, "router")
            _set_status(grpc_context, error)
            # Serve ships the context with each yielded message, so a status set after the
            # last one (or with none) is lost; raising carries it (as gRPCStatusError). A
            # plain RuntimeError: the proxy must unpickle it without importing this module
            raise RuntimeError(error.message) from None

    async def GetModelInfo(self, request, grpc_context=None) -> pb.ModelInfo:
        if not self._authorized(grpc_context):
            return pb.ModelInfo()
        i = await self._model_info()
        return pb.ModelInfo(target_model=i["target"], draft_model=i["draft"], vocab_size=i["vocab_size"],
                            max_model_len=i["max_model_len"], attention_backend=i["attention_backend"],
                            dtype=i["dtype"], block_size=i["block_size"], placement=i["placement"])

    async def GetStats(self, request, grpc_context=None) -> pb.Stats:
        if not self._authorized(grpc_context):  # replica ids, load and acceptance are not public
            return pb.Stats()
        snap = (await self.view.snapshot() if self.view  # the copy: never waits on the board
                else {"replicas": {}, "inflight": self.admission.inflight})
        out = pb.Stats()
        fields = pb.ReplicaStats.DESCRIPTOR.fields_by_name
        for rid, s in sorted(snap["replicas"].items()):
            out.replicas.append(pb.ReplicaStats(**{k: v for k, v in s.items() if k in fields}))
        out.metrics.update(cluster_metrics(snap["replicas"], snap["inflight"]))
        return out

    async def Check(self, request, grpc_context=None):
        """grpc.health.v1, open to probes without a key. The server ("") and the generation
        service are SERVING once a verifier replica reports, NOT_SERVING before; any other
        service name is NOT_FOUND, as the health protocol asks."""
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse
        if request.service not in ("", pb.DESCRIPTOR.services_by_name["Generation"].full_name):
            if grpc_context is not None:
                grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
                grpc_context.set_details(f"unknown service {request.service[:64]!r}")
            return status()
        ready = True
        if self.view is not None:
            ready = bool((await self.view.snapshot(KEEP_S))["replicas"])  # no flapping under load
        return status(status=status.SERVING if ready else status.NOT_SERVING)

    def _authorized(self, grpc_context) -> bool:
        """The API key of a call other than Generate (which checks it in _run); False with the
        call's status set."""
        meta = dict(grpc_context.invocation_metadata()) if grpc_context is not None else {}
        try:
            self.admission.authenticate(bearer_token(meta.get("authorization")),
                                        grpc_context.peer() if grpc_context is not None else "")
        except RequestError as e:
            _set_status(grpc_context, e)
            return False
        return True

    # ---- the request path --------------------------------------------------------------
    async def _run(self, request: pb.GenerateRequest, grpc_context, stream: bool = True):
        meta = dict(grpc_context.invocation_metadata()) if grpc_context is not None else {}
        peer = grpc_context.peer() if grpc_context is not None else ""
        # the key before anything else: a client without one learns nothing, not even
        # whether its bytes parsed
        client = self.admission.authenticate(bearer_token(meta.get("authorization")), peer)
        if isinstance(request, Undecodable):  # see cluster.serve.wire
            raise AdmissionError(ErrorKind.INVALID, f"request does not parse: {request.error}")
        call = replace(await self.admission.admit(_decode(request)), stream=stream)
        with self.admission.slot(client):
            async with aclosing(stream_outputs(self.verifier, call, self.cfg.router.failover_wait_s)) as outs:
                async for out in outs:
                    yield out

    async def _model_info(self) -> dict:
        if self._info is None:
            self._info = await self.verifier.model_info.remote()
        return self._info
