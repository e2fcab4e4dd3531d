"""Cache-aware routing to Verifier replicas: a Ray Serve custom request router.

Serve builds one request router per DeploymentHandle, in the caller's process (here the
Router replica), and asks `choose_replicas` for ranked groups of replicas for each call.
For a `generate` call we hash the prompt's blocks, ask the KV directory which replicas
already hold the leading ones, and rank prefix overlap against load (`RoutingPolicy.rank`,
a pure function). Calls without a prompt (stats, model_info), a single candidate, or a
directory that is down get Serve's power-of-two choice on queue length.

Serve pickles this module by value into every process that holds a Verifier handle, so
module globals stay plain: the directory and the gauge are made lazily, in that process.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cluster.engine.config import EngineConfig
from cluster.engine.scheduling.hashing import block_hashes, model_seed
from cluster.serve.calls import GenerateCall

log = logging.getLogger(__name__)

DEAD_MEMORY_S = 600.0  # the controller replaces a dead replica well within this


@dataclass(frozen=True)
class ReplicaLoad:
    replica_id: str
    sequences: float        # running + waiting sequences
    verify_tokens: float    # verify tokens per engine step (the replica's moving average)


@dataclass(frozen=True)
class RoutingPolicy:
    overlap_weight: float = 1.0
    load_weight: float = 1.0
    max_imbalance: float = 2.0
    imbalance_abs: float = 8.0
    # a replica's capacity; the defaults are the engine's (cluster.engine.config), set per
    # deployment from its engine config (cluster.serve.app.request_router_config)
    max_num_seqs: int = EngineConfig.model_fields["max_num_seqs"].default
    max_batch_tokens: int = EngineConfig.model_fields["max_batch_tokens"].default

    def load_norm(self, r: ReplicaLoad) -> float:
        """Fraction of a replica's capacity in use: slots or step budget, whichever binds."""
        return max(r.sequences / self.max_num_seqs, r.verify_tokens / self.max_batch_tokens)

    def rank(self, loads: list[ReplicaLoad], overlap: dict[str, int], num_blocks: int,
             rng: random.Random | None = None) -> tuple[list[str], str]:
        """Replica ids best first, and the reason for the first.

        score = overlap_weight * overlap_fraction - load_weight * load_norm. A replica running
        more than max_imbalance times the least loaded one's sequences, and more than
        imbalance_abs sequences beyond them, is left out, so one hot prefix spills onto other
        replicas instead of queueing on its holder (SGLang's router tests the same two
        thresholds). Both, because a few sequences more cost a step little while a miss costs
        its whole prefill: with "+ 1" alone a holder of 2 was left out beside an idle replica.
        The least loaded replica always qualifies, so the ranking is never empty. Equal scores
        are broken at random, so new prefixes spread over idle replicas.
        """
        least = min(r.sequences for r in loads)
        bound = max(self.max_imbalance * least, least + self.imbalance_abs)
        eligible = [r for r in loads if r.sequences <= bound]
        (rng or random).shuffle(eligible)

        def score(r: ReplicaLoad) -> float:
            frac = overlap.get(r.replica_id, 0) / num_blocks if num_blocks else 0.0
            return self.overlap_weight * frac - self.load_weight * self.load_norm(r)

        eligible.sort(key=score, reverse=True)
        best = eligible[0]
        held = overlap.get(best.replica_id, 0)
        reason = (f"overlap {held}/{num_blocks} blocks" if held else "no overlap, load only") + \
            f", {best.sequences:g} seqs, score {score(best):.3f}"
        if len(eligible) < len(loads):
            reason += f"; {len(loads) - len(eligible)} over the imbalance bound {bound:g}"
        return [r.replica_id for r in eligible], reason


class PrefixLoadRouter(RequestRouter):
    """`request_router_kwargs`: cluster, model, url, ttl_s, block_size and the
    RoutingPolicy fields (see cluster.serve.app.request_router_config)."""

    def initialize_state(self, cluster: str = "default", model: str = "", url: str | None = None,
                         ttl_s: float = 10.0, block_size: int = 16, **policy) -> None:
        self._policy = RoutingPolicy(**policy)
        self._dir_args = (url, cluster, model, ttl_s)
        self._block_size = block_size
        self._seed = model_seed(model)
        self._directory = None
        self._gauge = None
        self._available: bool | None = None
        self._dead: dict[str, float] = {}  # replica id -> when a call found it dead

    def _ensure_directory(self):
        """Made on first use, on the loop that routes (the Redis client binds to it)."""
        if self._directory is None:
            from ray.util.metrics import Gauge

            from cluster.kvdir import make_directory

            url, cluster, model, ttl_s = self._dir_args
            self._directory = make_directory(url, cluster, model, ttl_s)
            self._gauge = Gauge("kvdir_available", description="1 while the KV block directory answers, "
                                "else 0 (routing on load only)", tag_keys=("deployment",))
            self._gauge.set_default_tags({"deployment": self._deployment_id.name})
        return self._directory

    async def _overlap(self, hashes: list[int]) -> dict[str, int] | None:
        """Replica -> leading blocks held; None while the directory is down."""
        directory = self._ensure_directory()
        overlap = await directory.overlap(hashes)
        up = directory.available
        if up != self._available:
            # The Redis backend already warns (once a minute) with the cause; a second
            # warning here would only repeat it.
            self._available = up
            self._gauge.set(1 if up else 0)
            log.debug("kv directory %s", "available" if up else "unavailable: routing on load only")
        return overlap if up else None

    def on_replica_actor_died(self, replica_id) -> None:
        # Serve drops the replica here, but a replica-set update that the controller sent
        # before it noticed the death puts it back; a call routed there fails again. A
        # replica id never comes back to life (a replacement gets a new one), so remember it.
        now = time.monotonic()
        self._dead = {rid: t for rid, t in self._dead.items() if now - t < DEAD_MEMORY_S}
        self._dead[replica_id.unique_id] = now
        super().on_replica_actor_died(replica_id)

    def _load(self, r: RunningReplica) -> ReplicaLoad:
        stats = r.routing_stats or {}
        # The queue-length cache counts this handle's sends at once and is corrected by
        # each replica's reply; routing_stats arrive only every stats period.
        seqs = self.replica_queue_len_cache.get(r.replica_id)
        if seqs is None:
            seqs = stats.get("running", 0) + stats.get("waiting", 0)
        return ReplicaLoad(r.replica_id.unique_id, float(seqs), float(stats.get("verify_tokens", 0.0)))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        args = pending_request.args if pending_request is not None else None
        call = args[0] if args and isinstance(args[0], GenerateCall) else None
        candidate_replicas = [r for r in candidate_replicas if r.replica_id.unique_id not in self._dead]
        if call is None or len(candidate_replicas) < 2:
            return self._power_of_two(candidate_replicas)
        hashes = block_hashes(call.prompt_ids, self._block_size, self._seed)
        overlap: dict[str, int] | None = {}
        if hashes:
            overlap = await self._overlap(hashes)
            if overlap is None:
                return self._power_of_two(candidate_replicas)
        order, reason = self._policy.rank([self._load(r) for r in candidate_replicas], overlap, len(hashes))
        log.debug("route %s -> %s: %s", call.request_id, order[0], reason)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        # One replica per rank: Serve takes the first whose queue has room.
        return [[by_id[rid]] for rid in order]

    @staticmethod
    def _power_of_two(candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Serve's default: two random replicas, the shorter queue wins."""
        return [random.sample(candidates, min(2, len(candidates)))] if candidates else []
