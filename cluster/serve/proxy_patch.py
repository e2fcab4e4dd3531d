"""Two fixes to Serve's gRPC proxy: it binds network.host, as its HTTP proxy does, and a client
that cancels a stream cancels the call behind it.

Ray 2.60's gRPC proxy binds `[::]:<port>` whatever the HTTP options' host says
(`grpc_util.start_grpc_server`) and Serve has no option for it. `apply`, run in every worker
of the job that starts Serve (the worker setup hook `launch.RUNTIME_ENV`; the proxies are
such workers), makes it bind `SPEC_CLUSTER_GRPC_HOST`, which the controller's env hands the
proxies (`launch.controller_options`). So a default `spec-cluster up` serves generation on
loopback only. Written against Ray 2.60 (pyproject pins it); under any other version it
patches nothing and says so, rather than patch code it has not read (tests/serve/test_listen.py
pins the version too).

The proxy's streaming handler is an async generator that grpc drives. A cancel that lands
while grpc writes one of its messages (not while the handler awaits the next output) cancels
grpc's task, and the handler stays suspended at its `yield`: Serve's own cancel of the call
(in ProxyResponseGenerator.__anext__) never runs, so the router and verifier go on generating
for nobody until max_tokens. `_cancel_on_disconnect` cancels the call from the RPC's done
callback instead, which grpc runs however the RPC ended, unless the call had sent its OK
status (Ray's own proxy PRs #40761 and #42665 chase the same gap).
"""

from __future__ import annotations

import logging
import os

RAY_VERSION = "2.60.0"
HOST_ENV = "SPEC_CLUSTER_GRPC_HOST"


def apply() -> None:
    """The worker setup hook: patch when this process is (or may become) a Serve proxy."""
    import ray

    if ray.__version__ != RAY_VERSION:
        logging.getLogger(__name__).warning("Ray %s, not %s: Serve's gRPC proxy left as it is (it binds [::])",
                                            ray.__version__, RAY_VERSION)
        return
    _bind_host()
    _cancel_on_disconnect()


def _bind_host() -> None:
    from ray.serve._private import default_impl

    host = os.environ.get(HOST_ENV)
    if not host or getattr(default_impl.add_grpc_address, "patched", False):
        return
    original = default_impl.add_grpc_address

    def add_grpc_address(server, address: str):
        port = address.rpartition(":")[2]
        return original(server, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    add_grpc_address.patched = True
    default_impl.add_grpc_address = add_grpc_address


class _Recording:
    """A deployment handle that keeps the responses of its `remote` calls."""

    def __init__(self, handle):
        self._handle, self.responses = handle, []

    def remote(self, *args, **kwargs):
        response = self._handle.remote(*args, **kwargs)
        self.responses.append(response)
        return response

    def __getattr__(self, name):
        return getattr(self._handle, name)


def _cancel_on_disconnect() -> None:
    import grpc
    from ray.serve._private.proxy import gRPCProxy
    from ray.serve._private.proxy_request_response import ResponseStatus

    original = gRPCProxy.send_request_to_replica
    if getattr(original, "patched", False):
        return

    def send_request_to_replica(self, request_id, internal_request_id, handle, proxy_request, *args, **kwargs):
        recording, ended = _Recording(handle), []

        def done(context) -> None:
            # Not `context.cancelled()`: for a client that left while grpc wrote a message it
            # is False (17 of 500 in tests/serve/test_cancel.py's setting under load), and those
            # are the calls whose handler stays suspended. A call that ended OK has nothing to cancel.
            if not ended:
                for r in recording.responses:
                    r.cancel()

        async def watched():
            async for message in original(self, request_id, internal_request_id, recording, proxy_request,
                                          *args, **kwargs):
                if isinstance(message, ResponseStatus) and message.code == grpc.StatusCode.OK:
                    ended.append(True)  # the last message: the call ran to its end
                yield message

        proxy_request.context.add_done_callback(done)
        return watched()

    send_request_to_replica.patched = True
    gRPCProxy.send_request_to_replica = send_request_to_replica
