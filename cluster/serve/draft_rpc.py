"""The verifier -> drafter hop: one ZeroMQ request per engine step, protobuf-encoded
(protos/speccluster/v1/drafting.proto).

The Drafter deployment binds a ROUTER socket beside its Serve replica and tells callers its
address through the Serve handle (`endpoint`); the verifier's engine thread sends each
step's one draft call straight to it on a DEALER socket and waits on that socket itself.
Serve still places, scales, health-checks and replaces the replicas; only the per-step call
skips Serve's request path. Why not Serve's handle or a gRPC stub: on the GPU host a Serve
handle round trip costs 3.7 ms and a direct gRPC call 0.83 ms against a decode step of 6 ms,
and gRPC's Python server and future hand every reply across two more threads (each a GIL
handover); a ZeroMQ round trip is a fraction of that (`python -m cluster.bench.hop_bench`,
benchmarks/hop). vLLM's engine client talks to its engine core the same way.

Frames: request [call id, ProposeRequest]; reply [call id, OK, ProposeReply] or
[call id, ERR, message]. The call id lets a caller drop the late reply of a call it gave up on.

Several verifiers may share one drafter replica: the calls waiting when the server looks are
answered by one drafter pass over all their rows (`propose_many`), so k verifiers cost the
drafter one batched step, not k steps in a row.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import defaultdict

import numpy as np
import torch
import zmq

from cluster.engine.drafters.base import DraftOutput, DraftRequest
from cluster.engine.sampling import SamplingParams
from cluster.proto import drafting_pb2 as pb

OK, ERR = b"ok", b"err"


AUX_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def encode_request(requests: list[DraftRequest], starts: list[int], release: list[str],
                   caller: str, drafter: str = "") -> pb.ProposeRequest:
    """`starts[i]`: tokens of request i the drafter already holds, which are not sent again."""
    rows = []
    for r, start in zip(requests, starts):
        p = r.params
        row = pb.DraftRow(seq_id=r.seq_id, token_ids=r.token_ids[start:], k=r.k, temperature=p.temperature,
                          top_p=p.top_p, top_k=p.top_k, start=start)
        if p.seed is not None:
            row.seed = p.seed
        if r.aux is not None:  # raw bytes in the target's dtype (bf16 on a GPU: 2 bytes a value)
            a = r.aux.detach().contiguous().cpu()
            row.aux, row.aux_start, row.aux_rows = a.view(torch.uint8).numpy().tobytes(), r.aux_start, len(a)
            row.aux_dtype = str(a.dtype).removeprefix("torch.")
        rows.append(row)
    return pb.ProposeRequest(rows=rows, release=release, caller=caller, drafter=drafter)


def decode_request(msg: pb.ProposeRequest) -> tuple[list[DraftRequest], list[int], list[str], str]:
    """Requests whose token_ids are the rows' tokens from their start on, and the starts
    (the drafter named is `msg.drafter`)."""
    reqs = []
    for r in msg.rows:
        req = DraftRequest(r.seq_id, list(r.token_ids), r.k,
                           SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                          seed=r.seed if r.HasField("seed") else None))
        if r.aux_rows:
            raw = torch.frombuffer(bytearray(r.aux), dtype=torch.uint8)
            req.aux, req.aux_start = raw.view(AUX_DTYPES[r.aux_dtype]).view(r.aux_rows, -1), r.aux_start
        reqs.append(req)
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


def split_output(out: DraftOutput, counts: list[int]) -> list[DraftOutput]:
    """One DraftOutput per call, from the output of their rows drafted together: every
    per-row field sliced, the rest (seconds: the pass's time) shared."""
    total, parts, at = sum(counts), [], 0
    for n in counts:
        fields = {}
        for f in dataclasses.fields(out):
            v = getattr(out, f.name)
            fields[f.name] = v[at: at + n] if isinstance(v, list) and len(v) == total else v
        parts.append(DraftOutput(**fields))
        at += n
    return parts


class DraftServer:
    """Answers draft calls on one thread with `propose(requests, starts, release, caller)
    -> (DraftOutput, resync per row)`, one at a time in arrival order; with `propose_many
    (calls, drafter=...) -> [(DraftOutput, resync)]`, the calls of different callers waiting
    together for the same drafter are drafted as one batch."""

    def __init__(self, propose, host: str, port: int = 0, propose_many=None):
        self.propose, self.propose_many = propose, propose_many
        self.context = zmq.Context()  # its own, so that stop() can end it
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.linger = 0
        try:
            if port:
                self.socket.bind(f"tcp://{host}:{port}")
            else:
                port = self.socket.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            self.socket.close()
            self.context.term()
            raise RuntimeError(f"drafter could not bind {host}:{port}: {e}") from e
        self.address = f"tcp://{host}:{port}"
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, name="drafting", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while not self.stopping:
                if self.socket.poll(100):  # wakes at once on a call; the timeout only notices stop()
                    calls = self._waiting()
                    for frames, reply in zip(calls, self._answer_all([f[2] for f in calls])):
                        self.socket.send_multipart(frames[:2] + reply)
        finally:
            self.socket.close()
            self.context.term()

    def _waiting(self) -> list[list[bytes]]:
        """Every call that has arrived: [caller's identity, call id, request] each; anything
        else is not ours."""
        calls = []
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return calls
            if len(frames) == 3:
                calls.append(frames)

    def _answer_all(self, bodies: list[bytes]) -> list[list[bytes]]:
        """Replies in the calls' order. Calls naming the same drafter from different callers
        form one batch; a caller's second call waits for a later batch (its rows continue
        what the first one drafts)."""
        replies: list[list[bytes] | None] = [None] * len(bodies)
        batches: dict[tuple[str, int], list[tuple[int, tuple]]] = defaultdict(list)
        seen: dict[tuple[str, str], int] = defaultdict(int)  # (drafter, caller) -> calls so far
        for i, body in enumerate(bodies):
            try:
                msg = pb.ProposeRequest.FromString(body)
                args = decode_request(msg)
            except Exception as e:  # noqa: BLE001 - a malformed call: an error reply, not a dead server
                replies[i] = _error(e)
                continue
            round_ = seen[msg.drafter, msg.caller]
            seen[msg.drafter, msg.caller] += 1
            batches[msg.drafter, round_].append((i, args))
        for (drafter, _), items in sorted(batches.items(), key=lambda kv: kv[0][1]):
            named = {"drafter": drafter} if drafter else {}  # "": the draft model
            try:
                if len(items) > 1 and self.propose_many is not None:
                    results = self.propose_many([args for _, args in items], **named)
                else:
                    results = [self.propose(*args, **named) for _, args in items]
                for (i, _), result in zip(items, results):
                    replies[i] = [OK, encode_output(*result).SerializeToString()]
            except Exception as e:  # noqa: BLE001 - the verifiers decode without drafts this step
                for i, _ in items:
                    replies[i] = _error(e)
        return replies

    def stop(self) -> None:
        self.stopping = True
        if self.thread is not threading.current_thread():
            self.thread.join()


def _error(e: Exception) -> list[bytes]:
    return [ERR, f"drafter failed: {type(e).__name__}: {e}".encode()]


class DraftError(RuntimeError):
    """The drafter answered with an error, or not in time."""


class DraftingClient:
    """One socket to one drafter replica. `propose` sends at once and returns the pending
    call; waiting on it reads the socket on the caller's thread. Not thread-safe: the
    verifier's engine thread is its one user."""

    def __init__(self, address: str):
        self.address = address
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.linger = 0  # close() drops what a dead replica never took
        # A replica that dies closes its end: the monitor says so at once, and every call
        # waiting on it fails then rather than at its timeout (a step waited the full
        # drafter_timeout_s on a dead drafter before).
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.lost = False
        self.socket.connect(address)
        self.ids = itertools.count()
        self.waiting: dict[bytes, _Call] = {}
        self.sent_bytes = 0  # request bytes sent so far (what a step ships, aux states included)

    def propose(self, requests: list[DraftRequest], starts: list[int], release: list[str], caller: str,
                timeout_s: float, drafter: str = "") -> "_Call":
        if self.lost:
            raise DraftError(f"drafter {self.address} closed the connection")
        call = _Call(self, str(next(self.ids)).encode(), time.monotonic() + timeout_s)
        body = encode_request(requests, starts, release, caller, drafter).SerializeToString()
        self.sent_bytes += len(body)
        try:
            self.socket.send_multipart([call.id, body], zmq.NOBLOCK)
        except zmq.Again:  # the queue to an unreachable replica is full
            raise DraftError(f"drafter {self.address} is not taking calls") from None
        self.waiting[call.id] = call
        return call

    def receive(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for one reply and hand it to its call; replies to calls
        given up on are dropped."""
        ready = dict(self.poller.poll(max(0, int(timeout_s * 1000))))
        if self.monitor in ready:
            from zmq.utils.monitor import recv_monitor_message

            if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED:
                self.lost = True
        if self.socket in ready:
            frames = self.socket.recv_multipart()
            call = self.waiting.pop(frames[0], None)
            if call is not None:
                call.reply = frames[1:]

    def poll_now(self) -> bool:
        """Whether a reply (or the monitor's event) is waiting to be read."""
        return bool(self.poller.poll(0))

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close()
        self.waiting.clear()


class _Call:
    """A pending Propose with the DeploymentResponse surface RemoteDrafter uses; after
    `result`, `resync` names the rows the drafter could not extend."""

    def __init__(self, client: DraftingClient, call_id: bytes, deadline: float):
        self.client, self.id, self.deadline = client, call_id, deadline
        self.reply: list[bytes] | None = None
        self.resync: list[bool] = []

    def result(self, timeout_s: float | None = None) -> DraftOutput:
        deadline = self.deadline if timeout_s is None else min(self.deadline, time.monotonic() + timeout_s)
        while self.reply is None:
            left = deadline - time.monotonic()
            if self.client.lost:
                self.cancel()
                raise DraftError(f"drafter {self.client.address} closed the connection")
            if left <= 0 and self.id in self.client.waiting:
                # the deadline passed while this thread was not reading (a GC pause, a loaded
                # host): a reply already in the socket still counts
                while self.reply is None and self.id in self.client.waiting and self.client.poll_now():
                    self.client.receive(0)
            if self.reply is not None:
                break
            if left <= 0 or self.id not in self.client.waiting:
                self.cancel()
                raise DraftError(f"drafter {self.client.address} did not answer in time")
            self.client.receive(left)
        status, body = self.reply
        if status != OK:
            raise DraftError(body.decode(errors="replace"))
        out, self.resync = decode_output(pb.ProposeReply.FromString(body))
        return out

    def cancel(self) -> None:
        self.client.waiting.pop(self.id, None)

    def done(self) -> bool:
        while (self.reply is None and self.id in self.client.waiting and not self.client.lost
               and (self.client.socket.poll(0) or self.client.monitor.poll(0))):
            self.client.receive(0)
        return self.reply is not None or self.id not in self.client.waiting or self.client.lost
