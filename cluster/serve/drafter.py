"""The Drafter deployment and the verifier-side client that calls it.

One `propose` call per verifier step and drafter carries every sequence of the batch. A
replica hosts every drafter the config can place apart (cluster.serve.build.remote_drafters:
the draft model, EAGLE-3), and each call names one; an EAGLE-3 call carries the target's aux
hidden states of the tokens accepted since the last one (cluster.serve.draft_rpc). Finished
sequences ride along in the next call (or an idle flush) as `release`, so there is never a
per-token or per-request hop. Any drafter replica can serve any call: the request carries
the tokens, and a replica without state for a sequence rebuilds it.

The call goes straight to one replica's ZeroMQ socket (cluster.serve.draft_rpc), found through
the Serve handle and looked up again after a failure and every `REFRESH_S`, so new replicas
get callers; `router.drafter_transport: handle` sends it through Serve's request path instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future

import numpy as np
from ray import serve

from cluster.engine.drafters.base import Drafter, DraftOutput, DraftRequest
from cluster.policy.autoscaling import DraftDemandMeter

log = logging.getLogger(__name__)


def bind_host(setting: str) -> str:
    """The address for the draft-call socket (network.drafter_host): loopback keeps the port
    off the network where every caller shares this host."""
    import ray

    own = ray.util.get_node_ip_address()
    if setting == "node":
        return own
    if setting != "auto":
        return setting
    if not ray.is_initialized():  # built outside a cluster (tests): every caller is local
        return "127.0.0.1"
    hosts = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    return "127.0.0.1" if hosts <= {own} else own


@serve.deployment(name="Drafter")
class DrafterDeployment:
    def __init__(self, config: dict):

        from cluster.config import ClusterConfig
        from cluster.serve.build import build_eagle3_drafter, build_model_drafter, remote_drafters
        from cluster.serve.draft_rpc import DraftServer

        cfg = ClusterConfig.model_validate(config)
        builders = {"model": build_model_drafter, "eagle3": build_eagle3_drafter}
        self.drafters = {name: builders[name](cfg) for name in remote_drafters(cfg)}
        for d in self.drafters.values():  # kernel variants and CUDA graphs now, not in the middle of a step
            d.warm_up()
        self.calls = dict.fromkeys(self.drafters, 0)  # draft calls served, by drafter
        self.lock = threading.RLock()  # propose_from holds it across propose
        self.server = DraftServer(self.propose_from, bind_host(cfg.network.drafter_host),
                                  propose_many=self.propose_many)
        self.demand = DraftDemandMeter()
        # a verifier that dies never releases its sequences: they expire instead
        self.ttl_s = cfg.router.drafter_state_ttl_s
        self.last_used: dict[str, float] = {}

    @property
    def drafter(self):
        """The draft model's drafter (the one a call that names none means)."""
        return self.drafters.get("model") or next(iter(self.drafters.values()))

    def propose(self, requests: list[DraftRequest], release: list[str], caller: str = "",
                drafter: str = "model") -> DraftOutput:
        """A call through Serve's request path (router.drafter_transport: handle)."""
        self.demand.note_call(caller, sum(r.k for r in requests))
        with self.lock:
            return self._draft(requests, release, drafter, calls=1 if requests else 0)

    def _draft(self, requests: list[DraftRequest], release: list[str], drafter: str, calls: int) -> DraftOutput:
        self._forget(release)
        now = self._expire()
        self.last_used.update((r.seq_id, now) for r in requests)
        if not requests:  # release-only calls (an idle flush) or a verifier's probe
            return DraftOutput([], [], [])
        self.calls[drafter] += calls
        return self.drafters[drafter].propose(requests)

    def propose_from(self, requests: list[DraftRequest], starts: list[int], release: list[str],
                     caller: str = "", drafter: str = "model") -> tuple[DraftOutput, list[bool]]:
        """The direct call: each request's token_ids continue the `start` tokens this replica
        holds for it. A row whose start it lacks (evicted, or another replica drafted it) is
        answered `resync`, with no drafts; its verifier sends all its tokens next time."""
        return self.propose_many([(requests, starts, release, caller)], drafter)[0]

    def propose_many(self, calls: list[tuple], drafter: str = "model") -> list[tuple[DraftOutput, list[bool]]]:
        """Direct calls of several verifiers, drafted as one batch: (DraftOutput, resync) each."""
        from cluster.serve.draft_rpc import split_output

        with self.lock:
            rows, release, counts, resyncs = [], [], [], []
            for requests, starts, rel, caller in calls:
                self.demand.note_call(caller, sum(r.k for r in requests))
                resyncs.append([self._resume(r, start, drafter) for r, start in zip(requests, starts)])
                rows += requests
                release += rel
                counts.append(len(requests))
            out = self._draft(rows, release, drafter, calls=sum(1 for n in counts if n))
        parts = split_output(out, counts) if rows else [DraftOutput([], [], []) for _ in calls]
        return list(zip(parts, resyncs))

    def _resume(self, r: DraftRequest, start: int, drafter: str) -> bool:
        """Put back the `start` tokens held for r's sequence before its new ones; True (a
        resync) where they are not held: nothing of it is used, its tokens being a suffix
        of unknown place."""
        held = self.drafters[drafter].tokens_held(r.seq_id) if start else []
        if held is None or len(held) < start:
            r.k, r.aux = 0, None
            return True
        r.token_ids = held[:start] + r.token_ids
        return False

    def check_health(self) -> None:
        """Serve's periodic probe: a replica whose draft-call server has stopped answers no
        verifier (they decode without drafts), so have Serve replace it."""
        if not self.server.thread.is_alive():
            raise RuntimeError("the draft-call server has stopped")

    def endpoint(self) -> str:
        """Where this replica takes direct draft calls ("tcp://host:port")."""
        return self.server.address

    def __del__(self):
        if getattr(self, "server", None) is not None:
            self.server.stop()

    def info(self) -> dict:
        """Sequences with draft state here, draft calls served by drafter, where this replica runs."""
        import ray

        with self.lock:
            self._expire()
            return {"sequences": sum(len(d.state) for d in self.drafters.values()), "calls": dict(self.calls),
                    "node_id": ray.get_runtime_context().get_node_id(),
                    "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def _forget(self, seq_ids: list[str]) -> None:
        for d in self.drafters.values():
            d.release(seq_ids)
        for s in seq_ids:
            self.last_used.pop(s, None)

    def _expire(self) -> float:
        now = time.monotonic()
        stale = [s for s, t in self.last_used.items() if now - t > self.ttl_s]
        if stale:
            self._forget(stale)
        return now

    def record_autoscaling_stats(self) -> dict:
        return self.demand.report()


class _Pending(Future):
    def __init__(self, owner: "RemoteDrafter", response, release: list[str], requests: list[DraftRequest]):
        super().__init__()
        self.owner, self.response, self.release, self.requests = owner, response, release, requests
        self.sent = time.monotonic()

    def result(self, timeout=None):
        wait = self.owner.wait_s()
        try:
            out = self.response.result(timeout_s=wait)
        except Exception:
            self.response.cancel()  # a stale call must not run later on a recovered replica
            self.owner._failed(self.release)
            raise
        took = time.monotonic() - self.sent
        if took <= wait:  # one read late because this thread stalled (draft_rpc) says nothing of the replica
            self.owner.recent_s.append(took)
        resync = getattr(self.response, "resync", None)
        self.owner._succeeded(self.requests, resync)
        if resync and any(resync):  # those rows' aux states were dropped there: send them again
            out.unread = list(resync)
        return out


def _no_drafts(n: int) -> Future:
    """The reply of a step skipped while the drafter is down: nothing was sent, so every row
    is `unread` and the verifier keeps accumulating its aux states (EAGLE-3) for the replica
    to catch up on when it answers again, instead of dropping them and leaving a hole in
    the head's context (it would then restart from the first position it gets)."""
    fut: Future = Future()
    empty = np.zeros((0, 1), np.int32), np.zeros((0, 1), np.float32)
    fut.set_result(DraftOutput([[] for _ in range(n)], [empty[0]] * n, [empty[1]] * n, unread=[True] * n))
    return fut


class RemoteDrafter(Drafter):
    """Drafter interface over a drafter replica; failures surface as exceptions the engine
    treats as 'no drafts this step'.

    A failure is noticed at once where the replica died (its socket closes: cluster.serve.
    draft_rpc), else when a call takes several times longer than the slowest recent one (a
    hung replica closes no socket), and at the latest at the call's timeout. From then on the drafter is skipped (empty drafts,
    no call, no wait) while a probe on a thread of its own, off the steps' path, looks the
    replica up again and sends it an empty call, after a back-off that doubles up to
    `MAX_BACKOFF_S`; when one answers, the next step drafts again (through the probe's
    connection, with the direct transport)."""

    name = "model"
    look_ahead = "gated"  # the engine asks for the next step's drafts while this step verifies
    MIN_BACKOFF_S, MAX_BACKOFF_S = 0.5, 5.0
    # a call this many times the slowest recent one is lost; never sooner than MIN_WAIT_S, which
    # a stall of the caller's own process (a GC pause, a loaded host) should not reach
    SLOW_FACTOR, MIN_WAIT_S = 4.0, 0.5
    REFRESH_S = 30.0  # look the replica up again: callers spread onto replicas added since

    def __init__(self, handle, timeout_s: float, caller: str, transport: str = "direct", name: str = "model"):
        self.handle, self.timeout_s, self.caller = handle, timeout_s, caller
        self.name = name  # the replica's drafter each call names
        if name == "eagle3":  # its requests carry the target's states of verified tokens only
            self.look_ahead = None
        self.direct = transport == "direct"
        self.client = None  # DraftingClient to one replica (direct transport)
        self.refresh_at = 0.0
        # seq_id -> tokens that replica holds (direct transport): a call sends only the rest
        self.held: dict[str, int] = {}
        self.last_call = None
        self.pending_release: list[str] = []
        self.skip_until, self.backoff_s = 0.0, 0.0
        self.down = False  # since a failure, until a probe reaches a replica
        self.probe: threading.Thread | None = None
        self.recovered = None  # set by a probe that got an answer: its client (direct) or True
        self.recent_s: deque[float] = deque(maxlen=64)  # answered calls, from send to the reply's use

    def wait_s(self) -> float:
        """How long a step waits on its draft call: a hung replica costs a fraction of a
        second, not the whole `router.drafter_timeout_s`; until calls have been seen, that."""
        if len(self.recent_s) < 8:
            return self.timeout_s
        return min(self.timeout_s, max(self.MIN_WAIT_S, self.SLOW_FACTOR * max(self.recent_s)))

    def propose_async(self, requests: list[DraftRequest]) -> Future:
        if self.down and not self._back():
            return _no_drafts(len(requests))
        release, self.pending_release = self.pending_release, []
        try:
            response = self._send(requests, release)
        except Exception as e:  # no replica to be found: fail this call like a failed reply
            fut: Future = Future()
            fut.set_exception(e)
            self._failed(release)
            return fut
        return _Pending(self, response, release, requests)

    def _send(self, requests: list[DraftRequest], release: list[str]):
        if not self.direct:
            return self.handle.propose.remote(requests, release, self.caller, self.name)
        client = self._client()
        starts = [min(self.held.get(r.seq_id, 0), len(r.token_ids)) for r in requests]
        call = self.last_call = client.propose(requests, starts, release, self.caller, self.timeout_s,
                                               "" if self.name == "model" else self.name)
        # Counted as held once sent: the next call for a sequence goes out only after this
        # one's reply (or its failure, or a resync, which forget it again).
        for r in requests:
            self.held[r.seq_id] = len(r.token_ids) if r.confirmed is None else r.confirmed
        return call

    def _client(self):
        from cluster.serve.draft_rpc import DraftingClient

        now = time.monotonic()
        if self.client is None or now >= self.refresh_at:
            self.refresh_at = now + self.REFRESH_S
            try:
                address = self.handle.endpoint.remote().result(timeout_s=self.timeout_s)
            except Exception:
                if self.client is None:
                    raise
                return self.client  # a refresh is advice; the replica in hand still answers
            if self.client is None or self.client.address != address:
                if self.client is not None:
                    self.client.close()
                self.client = DraftingClient(address)
                self.held.clear()  # a new replica holds nothing of ours
                log.info("drafting through %s", address)
        return self.client

    def propose(self, requests: list[DraftRequest]) -> DraftOutput:
        return self.propose_async(requests).result()

    def release(self, seq_ids: list[str]) -> None:
        self.pending_release.extend(seq_ids)
        for sid in seq_ids:
            self.held.pop(sid, None)

    def flush(self) -> None:
        """Send pending releases now (the engine is idle): to the replica holding the state.
        Not while a call is still running there (a look-ahead no step will read): run after
        it, the release frees what that call drafted."""
        busy = self.last_call is not None and not self.last_call.done()
        if self.pending_release and not self.down and not busy:
            release, self.pending_release = self.pending_release, []
            try:
                self._send([], release)
            except Exception:
                self.pending_release[:0] = release

    def _failed(self, release: list[str]) -> None:
        # the call may or may not have run; releasing twice is harmless, never releasing leaks
        self.pending_release[:0] = release
        # The probe after the back-off looks the replica up again and calls on a fresh socket
        # (nothing stale still queued), sending every sequence's tokens in full once.
        self.refresh_at = 0.0
        if self.client is not None:
            self.client.close()
            self.client = None
        self.held.clear()
        if not self.backoff_s:
            log.warning("drafter unavailable; decoding without drafts, probing with back-off")
        self.backoff_s = min(self.MAX_BACKOFF_S, max(self.MIN_BACKOFF_S, 2 * self.backoff_s))
        self.skip_until = time.monotonic() + self.backoff_s
        self.down = True

    def _back(self) -> bool:
        """Whether a probe has reached a replica (then drafting resumes through it); else
        start one once the back-off has passed. Called on the engine thread only."""
        got, self.recovered = self.recovered, None
        if got is not None:
            if got is not True:  # the probe's connection, now this thread's
                self.client, self.refresh_at = got, time.monotonic() + self.REFRESH_S
            self.down = False
            log.warning("drafter %s answered a probe; drafting again", self.name)
            return True
        if time.monotonic() >= self.skip_until and (self.probe is None or not self.probe.is_alive()):
            self.probe = threading.Thread(target=self._probe, name=f"drafter-probe-{self.name}", daemon=True)
            self.probe.start()
        return False

    def _probe(self) -> None:
        """One empty call to whichever replica the handle names now (on its own thread)."""
        from cluster.serve.draft_rpc import DraftingClient

        drafter = "" if self.name == "model" else self.name
        client = None
        try:
            if self.direct:
                client = DraftingClient(self.handle.endpoint.remote().result(timeout_s=self.timeout_s))
                client.propose([], [], [], self.caller, self.timeout_s, drafter).result()
                self.recovered = client
            else:
                self.handle.propose.remote([], [], self.caller, self.name).result(timeout_s=self.timeout_s)
                self.recovered = True
        except Exception as e:  # noqa: BLE001 - still down: the next probe after a longer back-off
            if client is not None:
                client.close()
            self.backoff_s = min(self.MAX_BACKOFF_S, max(self.MIN_BACKOFF_S, 2 * self.backoff_s))
            self.skip_until = time.monotonic() + self.backoff_s
            log.warning("drafter %s probe failed (%s: %s); next in %.1f s", self.name, type(e).__name__,
                        str(e)[:120], self.backoff_s)

    def _succeeded(self, requests: list[DraftRequest], resync: list[bool] | None) -> None:
        for r, again in zip(requests, resync or ()):
            if again:
                self.held.pop(r.seq_id, None)
        if self.backoff_s:
            log.info("drafter reachable again; speculation resumes")
        self.skip_until, self.backoff_s = 0.0, 0.0
