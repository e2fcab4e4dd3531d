"""Blocking Python client for the speccluster.v1.Generation gRPC API.

    with Client("localhost:9000", application="spec") as client:
        print(client.generate("Hello", max_tokens=32, temperature=0.0).text)
        for chunk in client.generate_stream("Hello", speculation=4):
            print(chunk.text, end="")

Errors surface as `grpc.RpcError` (`.code()`, `.details()`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import grpc

from cluster.engine.drafters.registry import DRAFTERS
from cluster.proto import generation_pb2 as pb
from cluster.proto import generation_pb2_grpc as pb_grpc

Speculation = str | int | pb.Speculation | None
ADDRESS_ENV, DEFAULT_PORT = "SPEC_CLUSTER_ADDRESS", 9000


def server_address(address: str | None = None, port: int | None = None) -> str:
    """host:port of a server, from --address, else $SPEC_CLUSTER_ADDRESS, else localhost; `port`
    (--port) replaces the address's port, which defaults to 9000. IPv6 hosts in brackets."""
    addr = address or os.environ.get(ADDRESS_ENV) or "localhost"
    if addr.endswith("]") or ":" not in addr:
        host, own = addr, None
    else:
        host, _, own = addr.rpartition(":")
    return f"{host}:{port or own or DEFAULT_PORT}"

_SPEC_MODES = {"auto": pb.Speculation.AUTO, "off": pb.Speculation.OFF}


def speculation_proto(speculation: Speculation) -> pb.Speculation:
    """"auto" | "off" | gamma (int, FIXED) | None (server default) -> Speculation."""
    if speculation is None:
        return pb.Speculation()
    if isinstance(speculation, pb.Speculation):
        return speculation
    if isinstance(speculation, bool):  # bool is an int; True/False as gamma is a bug
        raise TypeError("speculation must be 'auto', 'off', an int gamma or None")
    if isinstance(speculation, int):
        if speculation < 0:
            raise ValueError(f"speculation gamma must be >= 0, got {speculation}")
        return pb.Speculation(mode=pb.Speculation.FIXED, gamma=speculation)
    if isinstance(speculation, str) and speculation.lower() in _SPEC_MODES:
        return pb.Speculation(mode=_SPEC_MODES[speculation.lower()])
    raise ValueError(f"speculation must be 'auto', 'off', an int gamma or None, got {speculation!r}")


def build_request(
    prompt: str,
    *,
    max_tokens: int = 0,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] = (),
    speculation: Speculation = None,
    drafter: str = "",
    model: str = "",
    request_id: str = "",
    logprobs: int | None = None,
) -> pb.GenerateRequest:
    """Build a GenerateRequest; None leaves an optional field unset (server default)."""
    if drafter and drafter not in DRAFTERS:
        raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)} or '', got {drafter!r}")
    request = pb.GenerateRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        stop=[stop] if isinstance(stop, str) else list(stop),
        speculation=speculation_proto(speculation),
        drafter=drafter,
        model=model,
        request_id=request_id,
    )
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed),
                        ("logprobs", logprobs)):
        if value is not None:
            setattr(request, name, value)
    return request


class Client:
    """One channel to a Serve gRPC proxy (or any server of the Generation service).

    application: the Serve app name, sent as the `application` metadata; the proxy
        needs it to route as soon as more than one app is deployed.
    api_key: sent as `authorization: Bearer <key>`.
    tls: None/False for plaintext, True for TLS with the system roots, or
        `grpc.ChannelCredentials`.
    timeout: deadline in seconds for each call (None: no deadline).
    """

    def __init__(
        self,
        address: str = "localhost:9000",
        timeout: float | None = None,
        api_key: str | None = None,
        tls: bool | grpc.ChannelCredentials | None = None,
        application: str | None = None,
    ):
        self.address = address
        self.timeout = timeout
        if tls:
            creds = grpc.ssl_channel_credentials() if tls is True else tls
            self._channel = grpc.secure_channel(address, creds)
        else:
            self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._metadata: list[tuple[str, str]] = []
        if application:
            self._metadata.append(("application", application))
        if api_key:
            self._metadata.append(("authorization", f"Bearer {api_key}"))

    def _call_kwargs(self, request_id: str = "") -> dict:
        metadata = list(self._metadata)
        if request_id:  # Serve adopts it as its own request id and logs it
            metadata.append(("request_id", request_id))
        return {"metadata": metadata, "timeout": self.timeout}

    def generate(self, prompt: str, **params) -> pb.GenerateResponse:
        request = build_request(prompt, **params)
        return self._stub.Generate(request, **self._call_kwargs(request.request_id))

    def generate_stream(self, prompt: str, **params) -> Iterator[pb.GenerateChunk]:
        request = build_request(prompt, **params)
        call = self._stub.GenerateStream(request, **self._call_kwargs(request.request_id))
        try:
            yield from call
        finally:
            call.cancel()  # a consumer that stops early frees the server's slot

    def model_info(self) -> pb.ModelInfo:
        return self._stub.GetModelInfo(pb.ModelInfoRequest(), **self._call_kwargs())

    def stats(self) -> pb.Stats:
        return self._stub.GetStats(pb.StatsRequest(), **self._call_kwargs())

    def health(self, service: str = "") -> str:
        """grpc.health.v1.Health/Check; returns the status name, e.g. "SERVING"."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # not on every image

        stub = health_pb2_grpc.HealthStub(self._channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), **self._call_kwargs())
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
