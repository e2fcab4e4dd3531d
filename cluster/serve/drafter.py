"""The Drafter deployment and the verifier-side client that calls it.

One `propose` call per verifier step carries every sequence of the batch. Finished
sequences ride along in the next call (or an idle flush) as `release`, so there is never a
per-token or per-request hop. Any drafter replica can serve any call: the request carries
the tokens, and a replica without state for a sequence rebuilds it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from ray import serve

from cluster.engine.drafter import Drafter, DraftOutput, DraftRequest
from cluster.policy.autoscaling import DraftDemandMeter


@serve.deployment(name="Drafter")
class DrafterDeployment:
    def __init__(self, config: dict):
        from cluster.config import ClusterConfig
        from cluster.serve.build import build_model_drafter

        cfg = ClusterConfig.model_validate(config)
        self.drafter = build_model_drafter(cfg)
        self.lock = threading.Lock()
        self.demand = DraftDemandMeter()

    def propose(self, requests: list[DraftRequest], release: list[str], caller: str = "") -> DraftOutput:
        self.demand.note_call(caller, sum(r.k for r in requests))
        with self.lock:
            self.drafter.release(release)
            return self.drafter.propose(requests)

    def release(self, seq_ids: list[str]) -> None:
        with self.lock:
            self.drafter.release(seq_ids)

    def info(self) -> dict:
        """Sequences with draft state here, and where this replica runs."""
        import ray

        with self.lock:
            return {"sequences": len(self.drafter.state), "node_id": ray.get_runtime_context().get_node_id()}

    def record_autoscaling_stats(self) -> dict:
        return self.demand.report()


class _Pending(Future):
    def __init__(self, response, timeout_s: float):
        super().__init__()
        self.response, self.timeout_s = response, timeout_s

    def result(self, timeout=None):
        return self.response.result(timeout_s=self.timeout_s)


class RemoteDrafter(Drafter):
    """Drafter interface over a Serve handle; failures surface as exceptions the engine
    treats as 'no drafts this step'."""

    name = "model"

    def __init__(self, handle, timeout_s: float, caller: str):
        self.handle, self.timeout_s, self.caller = handle, timeout_s, caller
        self.pending_release: list[str] = []

    def propose_async(self, requests: list[DraftRequest]) -> Future:
        release, self.pending_release = self.pending_release, []
        return _Pending(self.handle.propose.remote(requests, release, self.caller), self.timeout_s)

    def propose(self, requests: list[DraftRequest]) -> DraftOutput:
        return self.propose_async(requests).result()

    def release(self, seq_ids: list[str]) -> None:
        self.pending_release.extend(seq_ids)

    def flush(self) -> None:
        if self.pending_release:
            release, self.pending_release = self.pending_release, []
            self.handle.release.remote(release)
