"""The verifier -> drafter hop as a direct gRPC call (protos/speccluster/v1/drafting.proto).

The Drafter deployment runs a small gRPC server beside its Serve replica and tells callers
its address through the Serve handle (`endpoint`); the verifier then sends each step's one
draft call straight to it. Serve still places, scales, health-checks and replaces the
replicas; only the per-step call skips Serve's request path, which costs 2.5 ms a round trip
against 0.56 ms here (`python -m cluster.bench.hop_bench`, benchmarks/hop) on a decode step
of a few milliseconds.
"""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np

from cluster.engine.drafter import DraftOutput, DraftRequest
from cluster.engine.sampling import SamplingParams
from cluster.proto import drafting_pb2 as pb
from cluster.proto import drafting_pb2_grpc as pb_grpc

MAX_MESSAGE = 64 << 20  # a batch of long sequences is a few MB of token ids
OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]


def encode_request(requests: list[DraftRequest], starts: list[int], release: list[str],
                   caller: str) -> pb.ProposeRequest:
    """`starts[i]`: tokens of request i the drafter already holds, which are not sent again."""
    rows = []
    for r, start in zip(requests, starts):
        p = r.params
        row = pb.DraftRow(seq_id=r.seq_id, token_ids=r.token_ids[start:], k=r.k, temperature=p.temperature,
                          top_p=p.top_p, top_k=p.top_k, start=start)
        if p.seed is not None:
            row.seed = p.seed
        rows.append(row)
    return pb.ProposeRequest(rows=rows, release=release, caller=caller)


def decode_request(msg: pb.ProposeRequest) -> tuple[list[DraftRequest], list[int], list[str], str]:
    """Requests whose token_ids are the rows' tokens from their start on, and the starts."""
    reqs = [DraftRequest(r.seq_id, list(r.token_ids), r.k,
                         SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                        seed=r.seed if r.HasField("seed") else None))
            for r in msg.rows]
    return reqs, [r.start for r in msg.rows], list(msg.release), msg.caller


def encode_output(out: DraftOutput, resync: list[bool]) -> pb.ProposeReply:
    rows = []
    for toks, ids, probs, again in zip(out.tokens, out.q_ids, out.q_probs, resync):
        width = ids.shape[1] if len(toks) else 0
        rows.append(pb.Drafted(tokens=toks, width=width, q_ids=np.ascontiguousarray(ids, "<i4").tobytes(),
                               q_probs=np.ascontiguousarray(probs, "<f4").tobytes(), resync=again))
    return pb.ProposeReply(rows=rows, seconds=out.seconds)


def decode_output(msg: pb.ProposeReply) -> tuple[DraftOutput, list[bool]]:
    toks, ids, probs = [], [], []
    for r in msg.rows:
        n, k = len(r.tokens), max(r.width, 1)
        toks.append(list(r.tokens))
        ids.append(np.frombuffer(r.q_ids, "<i4").reshape(n, k) if n else np.zeros((0, 1), np.int32))
        probs.append(np.frombuffer(r.q_probs, "<f4").reshape(n, k) if n else np.zeros((0, 1), np.float32))
    return DraftOutput(toks, ids, probs, msg.seconds), [r.resync for r in msg.rows]


class _Servicer(pb_grpc.DraftingServicer):
    def __init__(self, propose):
        self.propose = propose

    def Propose(self, request, context):
        try:
            return encode_output(*self.propose(*decode_request(request)))
        except Exception as e:  # the verifier decodes without drafts this step
            context.abort(grpc.StatusCode.INTERNAL, f"drafter failed: {e}")


def serve_drafting(propose, host: str, port: int = 0, workers: int = 4) -> tuple[grpc.Server, str]:
    """Start a server that answers Propose with `propose(requests, starts, release, caller)
    -> (DraftOutput, resync per row)`; returns it and its "host:port" (port 0: any free one)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="drafting"),
                         options=OPTIONS)
    pb_grpc.add_DraftingServicer_to_server(_Servicer(propose), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise RuntimeError(f"drafter could not bind {host}:{port}")
    server.start()
    return server, f"{host}:{bound}"


class DraftingClient:
    """One channel to one drafter replica; `propose` returns a pending call."""

    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.insecure_channel(address, options=OPTIONS)
        self.stub = pb_grpc.DraftingStub(self.channel)

    def propose(self, requests: list[DraftRequest], starts: list[int], release: list[str], caller: str,
                timeout_s: float) -> "_Call":
        return _Call(self.stub.Propose.future(encode_request(requests, starts, release, caller), timeout=timeout_s))

    def close(self) -> None:
        self.channel.close()


class _Call:
    """A pending Propose with the DeploymentResponse surface RemoteDrafter uses; after
    `result`, `resync` names the rows the drafter could not extend."""

    def __init__(self, fut: grpc.Future):
        self.fut, self.resync = fut, []

    def result(self, timeout_s: float | None = None) -> DraftOutput:
        out, self.resync = decode_output(self.fut.result(timeout=timeout_s))
        return out

    def cancel(self) -> None:
        self.fut.cancel()

    def done(self) -> bool:
        return self.fut.done()
