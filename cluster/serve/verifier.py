"""The Verifier deployment: a replica's front to its engine core (cluster.serve.core), which
owns sequences, KV and the continuous-batching loop in a process of its own.

`generate` streams `RequestOutput`s for one `GenerateCall` (cluster.serve.calls); an
ingress consumes them. Request errors come back as an `ErrorOutput` item rather than an
exception, so their kind and message survive the hop unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import ray
from ray import serve

from cluster.engine.distributed.parallel import RankFailure
from cluster.engine.sampling import InvalidRequest
from cluster.engine.scheduling.scheduler import QueueFull
from cluster.policy.autoscaling import VerifyLoadMeter
from cluster.serve.calls import ErrorKind, ErrorOutput, GenerateCall
from cluster.serve.core_client import CoreGone
from cluster.serve.metrics import VerifierMetrics
from cluster.serve.stats import DRAFTING_S, FRESH_S, KEEP_S, REPORT_S, VerifierFigures

log = logging.getLogger(__name__)
UNARY_INTERVAL_S = 1.0


class ReplicaDown(RuntimeError):
    """This replica can serve nothing more (a tensor-parallel rank died). Raised, not sent as
    an ErrorOutput, so the router treats the call as broken and resubmits it elsewhere."""


@serve.deployment(name="Verifier")
class Verifier:
    """The engine runs in an EngineCore actor beside this replica (cluster.serve.core): this
    process only admits, fans each step's outputs out to the streams, and reports."""

    def __init__(self, config: dict, drafter=None, board=None):
        from cluster.config import ClusterConfig
        from cluster.serve.core_actor import socket_pair, start_core
        from cluster.serve.core_client import CoreClient

        cfg = ClusterConfig.model_validate(config)
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id if ctx else "local"
        self.node_id = ray.get_runtime_context().get_node_id()
        # what Ray gave this replica (the multi-GPU runs check that replicas meant to hold a GPU
        # of their own do): GPU ids as strings, as ray.get_gpu_ids() names them
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        self.cfg = cfg
        # Three readers (autoscaling, routing stats, GetStats), each with its own window.
        self.load = VerifyLoadMeter(readers=("autoscaling", "routing", "stats"))
        self.metrics = VerifierMetrics(self.replica_id, cfg.models.target)
        self.figures = VerifierFigures()  # the same figures for GetStats
        self.prefixes: set[int] = set()  # the core's cached prefix blocks, as its steps report them
        inbox, outbox = socket_pair()
        self.core, self.info = start_core(config, drafter, self.replica_id, inbox, outbox)
        self.done = self.core.run.remote()
        from cluster.config import resolve_model_path
        from cluster.engine.worker.loader import load_tokenizer

        self.client = CoreClient(inbox, outbox, self.info, on_step=self._on_step,
                                 tokenizer=load_tokenizer(resolve_model_path(cfg.models.target)))
        threading.Thread(target=self._watch, name="core-watch", daemon=True).start()
        self.stream_s = cfg.router.stream_interval_ms / 1e3
        self.stream_rate = cfg.router.stream_messages_per_s
        self.publisher = self._make_publisher(cfg)
        self.board = board
        self.drafted_at = (0, float("-inf"))  # the draft count, and when it last rose
        if board is not None:
            threading.Thread(target=self._report, name="stats-report", daemon=True).start()
        log.info("verifier %s ready: backend=%s placement=%s core pid %s", self.replica_id,
                 self.info["attention_backend"], cfg.placement, self.info["pid"])

    def _watch(self) -> None:
        """The core's run ends only when it is stopped or dies: either way nothing more comes."""
        try:
            ray.get(self.done)
            error = CoreGone("engine core stopped")
        except Exception as e:  # noqa: BLE001 - its death or its error, as Ray reports them
            error = CoreGone(f"engine core died: {type(e).__name__}")
        if self.client.alive:  # streams in flight end as if the replica died: the router fails them over
            self.client.gone(error)

    def _on_step(self, observations, stored, evicted) -> None:
        for obs in observations:
            self.load.note_step(obs.verify_tokens)
            self.metrics.step(obs)
            self.figures.step(obs)
        if stored or evicted:
            self.prefixes.update(stored)
            self.prefixes.difference_update(evicted)
            if self.publisher is not None:
                self.publisher.stored(stored)
                self.publisher.evicted(evicted)

    def _make_publisher(self, cfg):
        """Publish this replica's prefix blocks to the KV directory the router reads."""
        if not cfg.kvdir.url or not self.info["prefix_caching"]:
            return None
        from cluster.kvdir import BlockPublisher, make_directory

        directory = make_directory(cfg.kvdir.url, cfg.name, cfg.models.target, cfg.kvdir.ttl_s)
        pub = BlockPublisher(directory, self.replica_id, cfg.kvdir.ttl_s, snapshot=lambda: list(self.prefixes))
        try:
            pub.start()  # Serve runs __init__ on the replica's event loop
        except RuntimeError:  # built outside Serve: generate() starts it on its loop
            pass
        return pub

    async def generate(self, call: GenerateCall):
        if self.publisher is not None:
            self.publisher.start()  # no-op once running
        if not self.client.alive:  # the replica is going down (check_health): the router retries elsewhere
            raise ReplicaDown(f"verifier {self.replica_id} is down: {self.client.error}")
        try:
            sid, q = self.client.submit(call.prompt_ids, call.params, call.spec, call.drafter, call.request_id)
        except InvalidRequest as e:
            yield ErrorOutput(ErrorKind.INVALID, str(e))
            return
        except QueueFull as e:
            yield ErrorOutput(ErrorKind.EXHAUSTED, str(e))
            return
        finished, last, itl, sent = False, None, [], None
        try:
            while not finished:
                out = await q.get()
                if sent is not None and not _final(out):
                    # at most one message an interval: what comes meanwhile goes with it; the
                    # last output goes at once (a closed-loop client sends its next request then)
                    out = await _collect(out, q, self._interval(call.stream) - (time.perf_counter() - sent))
                out = _merge(out, q)
                if isinstance(out, (RankFailure, CoreGone)):  # as if the replica died: the router fails the call over
                    raise ReplicaDown(f"verifier {self.replica_id} lost its engine: {out}")
                if isinstance(out, (InvalidRequest, QueueFull)):  # refused when the engine took it
                    yield ErrorOutput(ErrorKind.INVALID if isinstance(out, InvalidRequest) else ErrorKind.EXHAUSTED,
                                      str(out))
                    return
                if isinstance(out, Exception):
                    yield ErrorOutput(ErrorKind.INTERNAL, f"verifier step failed: {out}")
                    return
                now = time.perf_counter()
                if last is not None and out.token_ids:  # a message's tokens share its interval
                    itl += [1e3 * (now - last) / len(out.token_ids)] * len(out.token_ids)
                last = now
                finished = out.finished
                if finished:
                    self.metrics.finished(out.stats["timing"], itl, self.client.hit_rate)
                    self.figures.finished(out.stats["timing"]["ttft_ms"], itl)
                    out.replica = self.replica_id  # the Router reports it (GenerateResponse.replica)
                yield out
                sent = time.perf_counter()
        finally:
            if not finished:  # cancelled by the caller, or its deadline passed: free everything
                self.client.abort(sid)

    def _interval(self, stream: bool) -> float:
        """Seconds between a stream's messages: stream_interval_ms, widened so that the replica
        sends about stream_messages_per_s in all. Serve's streaming costs per message at each
        hop (verifier -> router -> proxy): 256 streams at one message a step backed outputs
        up by seconds on an H100, the engine idling while finished requests waited to leave.
        A caller that wants the whole answer gets a message a second at most (the tokens so
        far still reach the router, for its failover)."""
        return max(self.stream_s if stream else UNARY_INTERVAL_S, len(self.client.queues) / self.stream_rate)

    async def stats(self) -> dict:
        return self._stats(await asyncio.wrap_future(self.client.request_stats()))

    async def pause(self, on: bool = True) -> dict:
        """Hold the engine between steps (on) or let it go on (off). Requests and aborts are
        still taken meanwhile; answers with the stats seen once it took effect."""
        return self._stats(await asyncio.wrap_future(self.client.pause(on)))

    def _stats(self, s: dict) -> dict:
        c = self.client
        s.update(replica=self.replica_id, node_id=self.node_id, gpu_ids=self.gpu_ids, step_messages=c.messages,
                 step_lag_s=c.lag_s,
                 verify_tokens=int(self.load.report("stats").get("verify_tokens", 0.0)), **self.figures.snapshot())
        if self.publisher is not None:
            s["kvdir_available"] = 1 if self.publisher.directory.available else 0
        if s.get("drafted", 0) > self.drafted_at[0]:
            self.drafted_at = (s["drafted"], time.monotonic())
        s["drafting"] = int(time.monotonic() - self.drafted_at[1] < DRAFTING_S)
        return s

    def model_info(self) -> dict:
        i = self.info
        return {"target": self.cfg.models.target, "draft": self.cfg.models.draft or "", "vocab_size": i["vocab_size"],
                "max_model_len": i["max_model_len"], "attention_backend": i["attention_backend"],
                "dtype": self.cfg.models.dtype, "block_size": i["block_size"], "placement": self.cfg.placement,
                # an ingress refuses a drafter this deployment lacks before the call is routed
                "drafters": i["drafters"]}

    def record_routing_stats(self) -> dict:
        return {"verify_tokens": self.load.report("routing").get("verify_tokens", 0.0),
                "running": self.client.running, "waiting": self.client.waiting}

    def record_autoscaling_stats(self) -> dict:
        return self.load.report("autoscaling")

    def check_health(self) -> None:
        if not self.client.alive:
            raise RuntimeError(f"engine core is down: {self.client.error}")

    def _report(self) -> None:
        """Push stats to the board every REPORT_S; take back the cluster's in-flight count for
        the controller from the previous push's answer, so a slow board never stretches the
        period (GetStats drops a replica silent for FRESH_S). The KV pool's and the drafting
        counts' metrics are set here too, whether or not steps run."""
        sent, late_logged = None, False
        while self.client.alive:
            started = time.monotonic()
            try:
                stats = self._stats(self.client.request_stats().result(timeout=FRESH_S))
                try:
                    self.metrics.report(stats)
                except Exception as e:  # metrics are advice too: the report still goes
                    log.debug("KV pool and drafting metrics failed: %s", e)
                if sent is not None:
                    try:
                        inflight, replicas = sent.result(timeout_s=0)
                        self.client.set_inflight(inflight, replicas)
                    except TimeoutError:
                        pass  # still on its way: its count is a period older next time
                sent = self.board.report.remote(self.replica_id, stats)
            except Exception as e:  # the board is advice; never let it hurt serving
                log.debug("stats report failed: %s", e)
            took = time.monotonic() - started
            if took > FRESH_S - REPORT_S and not late_logged:
                log.warning("a stats report took %.1f s; GetStats omits replicas silent for %.0f s", took, FRESH_S)
                late_logged = True
            time.sleep(max(0.0, REPORT_S - took))

    async def __del__(self):
        """Serve awaits this on clean shutdown: drop our directory entries now, not a TTL later."""
        if getattr(self, "client", None):
            self.client.stop()  # the core stops its followers (tensor parallel) and ends
        if getattr(self, "publisher", None) is not None:
            try:
                await asyncio.wait_for(self.publisher.stop(), timeout=2.0)
            except asyncio.TimeoutError:
                log.warning("kv directory cleanup timed out; entries expire after %ss", self.cfg.kvdir.ttl_s)
            await self.publisher.directory.close()


def _final(out) -> bool:
    return isinstance(out, Exception) or out.finished


async def _collect(out, q: asyncio.Queue, wait_s: float):
    """`out` and what of the same request comes within `wait_s`, as one output; sooner if the
    request finishes or fails meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while not _final(out):
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            more = await asyncio.wait_for(q.get(), left)
        except asyncio.TimeoutError:
            break
        out = _join(out, more)
    return out


def _join(out, more):
    """`out` followed by `more`; an exception ends the stream, so it wins."""
    return more if isinstance(more, Exception) else out.then(more)


def _merge(out, q: asyncio.Queue):
    """`out` and whatever of the same request waits behind it, as one output: a busy replica
    sends fewer, larger messages instead of falling behind. An exception waiting behind it
    wins (the stream ends with it)."""
    while not _final(out) and not q.empty():
        out = _join(out, q.get_nowait())
    return out


# quick calls that never block: no cap worth queueing the routers' and verifiers' calls behind
@serve.deployment(name="StatsBoard", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class StatsBoard:
    """Latest stats of each verifier and in-flight counts of each router (for GetStats and
    the controller's cluster concurrency signal). Entries older than KEEP_S are dropped;
    GetStats shows only those of the last FRESH_S: a replica that died leaves it within 2 s."""

    def __init__(self):
        self.replicas: dict[str, tuple[float, dict]] = {}
        self.routers: dict[str, tuple[float, int]] = {}

    def _live(self, table: dict) -> dict:
        now = time.monotonic()
        for k in [k for k, (t, _) in table.items() if now - t > KEEP_S]:
            table.pop(k)
        return table

    def report(self, replica: str, stats: dict) -> tuple[int, int]:
        self.replicas[replica] = (time.monotonic(), stats)
        return sum(n for _, n in self._live(self.routers).values()), len(self._live(self.replicas))

    def exchange(self, router: str, n: int) -> dict:
        """A router's periodic call: its in-flight count in; every replica's latest stats with
        their age in seconds, and the cluster's in-flight count, out."""
        now = time.monotonic()
        self.routers[router] = (now, n)
        return {"replicas": {k: (now - t, s) for k, (t, s) in self._live(self.replicas).items()},
                "inflight": sum(n for _, n in self._live(self.routers).values())}

    def snapshot(self, max_age_s: float = FRESH_S) -> dict:
        now = time.monotonic()
        return {"replicas": {k: s for k, (t, s) in self._live(self.replicas).items() if now - t <= max_age_s},
                "inflight": sum(n for _, n in self._live(self.routers).values())}
