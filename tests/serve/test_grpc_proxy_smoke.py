"""Ray Serve's gRPC proxy carries our Generation API end to end.

Proves the pattern in docs/ray_serve_grpc.md: a plain deployment class whose
method names match the RPC names, unary and server-streaming methods, status
codes set through `grpc_context`, grpc.health.v1 Check routed like any RPC,
routing by the `application` metadata, and client deadlines cancelling the
replica's coroutine.
"""

import asyncio
import socket
import time
from pathlib import Path

import grpc
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
health_pb2 = pytest.importorskip("grpc_health.v1.health_pb2")

from ray.serve.generated import serve_pb2, serve_pb2_grpc  # noqa: E402
from ray.serve.grpc_util import RayServegRPCContext  # noqa: E402

from cluster.client import Client  # noqa: E402
from cluster.proto import generation_pb2 as pb  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SERVICERS = [
    "cluster.proto.generation_pb2_grpc.add_GenerationServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


@serve.deployment(ray_actor_options={"num_cpus": 0})
class EchoIngress:
    def __init__(self, name: str):
        self.name = name
        self.cancelled = 0

    async def Generate(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext) -> pb.GenerateResponse:
        if request.max_tokens < 0:  # set the status and return: no exception logged
            grpc_context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            grpc_context.set_details(f"max_tokens must be >= 0, got {request.max_tokens}")
            return pb.GenerateResponse()
        if not request.prompt:  # set the status, then raise: Serve keeps the code
            grpc_context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            grpc_context.set_details("prompt is empty")
            raise ValueError("prompt is empty")
        if request.prompt.startswith("sleep "):
            try:
                await asyncio.sleep(float(request.prompt.split()[1]))
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        metadata = dict(grpc_context.invocation_metadata())
        return pb.GenerateResponse(
            text=request.prompt,
            token_ids=[len(request.prompt)],
            finish_reason="length",
            replica=f"{self.name}|{grpc_context.application()}|{metadata.get('authorization', '')}",
        )

    async def GenerateStream(self, request: pb.GenerateRequest):
        for i in range(3):
            final = i == 2
            yield pb.GenerateChunk(
                text=f"{request.prompt}{i}",
                token_ids=[i],
                final=final,
                finish_reason="length" if final else "",
                spec=pb.SpecStats(drafted=4, accepted=3) if final else None,
            )

    def GetStats(self, request: pb.StatsRequest) -> pb.Stats:
        return pb.Stats(metrics={"cancelled": self.cancelled})

    def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def address(serve_grpc):
    """Two echo apps on the session's Serve instance, so the proxy needs `application`."""
    serve.run(EchoIngress.bind("spec"), name="spec", route_prefix="/spec")
    serve.run(EchoIngress.bind("other"), name="other", route_prefix="/other")
    yield f"localhost:{serve_grpc}"
    serve.delete("spec")
    serve.delete("other")


def test_unary_routes_by_application_metadata(address):
    with Client(address, application="spec", api_key="k1") as client:
        response = client.generate("hello", max_tokens=4, temperature=0.0, speculation=3)
    assert response.text == "hello" and list(response.token_ids) == [5]
    assert response.replica == "spec|spec|Bearer k1"
    with Client(address, application="other") as client:
        assert client.generate("hi").replica == "other|other|"


def test_missing_or_unknown_application_is_not_found(address):
    for application in (None, "nope"):
        with Client(address, application=application) as client, pytest.raises(grpc.RpcError) as info:
            client.generate("hi")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_server_streaming(address):
    with Client(address, application="spec") as client:
        chunks = list(client.generate_stream("x"))
    assert [c.text for c in chunks] == ["x0", "x1", "x2"]
    assert [c.final for c in chunks] == [False, False, True]
    assert chunks[-1].finish_reason == "length" and chunks[-1].spec.accepted == 3


@pytest.mark.parametrize(
    ("params", "details"),
    [({"max_tokens": -1}, "max_tokens must be >= 0, got -1"), ({"prompt": ""}, "prompt is empty")],
    ids=["set-code-and-return", "set-code-and-raise"],
)
def test_status_code_and_details_reach_client(address, params, details):
    params = {"prompt": "hi", **params}
    with Client(address, application="spec") as client, pytest.raises(grpc.RpcError) as info:
        client.generate(params.pop("prompt"), **params)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == details


def test_standard_health_check_goes_through_the_proxy(address):
    with Client(address, application="spec") as client:
        assert client.health() == "SERVING"
    # Serve's own proxy health endpoint needs no application metadata.
    with grpc.insecure_channel(address) as channel:
        stub = serve_pb2_grpc.RayServeAPIServiceStub(channel)
        assert stub.Healthz(serve_pb2.HealthzRequest()).message == "success"


def test_client_deadline_cancels_the_replica_coroutine(address):
    # a deadline the call reaches the replica within on a loaded machine, far short of its sleep
    with Client(address, application="other", timeout=3.0) as client, pytest.raises(grpc.RpcError) as info:
        client.generate("sleep 60")
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with Client(address, application="other") as client:
        deadline = time.monotonic() + 30
        while client.stats().metrics["cancelled"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.stats().metrics["cancelled"] == 1
