"""EAGLE-3 in its own replica across an outage: while the replica is unreachable the verifier
decodes without drafts and keeps the aux hidden states of what it accepts; when a probe
reaches the replica again, the next call carries them, so the head's context is whole again
(the same as an uninterrupted run's), and greedy output never changed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cluster.engine.drafters.base import DraftRequest
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams

GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)
OUTAGE_STEPS = range(3, 9)  # engine steps (1 = the prefill) during which the replica is unreachable


class EndpointHandle:
    def __init__(self, address: str):
        self.endpoint = SimpleNamespace(remote=lambda: SimpleNamespace(result=lambda timeout_s=None: address))


def full_context_state(model, head, tokens: list[int]):
    """What an uninterrupted drafter holds at len(tokens): a fresh drafter fed the target's aux
    states of every position but the last, computed here in one target pass."""
    from cluster.engine.drafters.eagle3 import Eagle3Drafter
    from cluster.engine.scheduling.kv_cache import KVCache
    from cluster.engine.worker.runner import Runner

    s = model.shape
    kv = KVCache.dense(s.layers, 1, len(tokens) + 1, s.kv_heads, s.head_dim, torch.float32, "cpu")
    _, _, aux = Runner(model, kv, "sdpa").forward([0], [0], [tokens], last_only=False, aux=True)
    ref = Eagle3Drafter(head, 2, 1024)
    ref.propose([DraftRequest("ref", tokens, 4, GREEDY, aux=aux[0, :-1], aux_start=0)])
    return ref.state["ref"]


def test_eagle3_resumes_with_its_whole_context_after_an_outage(demo_pair):
    from cluster.config import parse_config
    from cluster.serve.build import build_engine, eagle3_dir
    from cluster.serve.draft_rpc import DraftServer
    from cluster.serve.drafter import DrafterDeployment, RemoteDrafter

    cfg = parse_config({"models": {"device": "cpu"}, "placement": "disaggregated", "kvdir": {"url": None}})
    if eagle3_dir(cfg) is None:
        pytest.skip("no EAGLE-3 head beside the demo target (spec-cluster models train-eagle3)")
    torch.manual_seed(0)
    replica = DrafterDeployment.func_or_class(cfg.model_dump())
    replica.server.stop()
    eagle = replica.drafters["eagle3"]
    down, recovered = [False], [False]
    after = []  # (tokens, the replica's state) at each call once it is back

    def serve(requests, starts, release, caller, drafter="model"):
        if down[0]:
            raise ConnectionError("drafter unreachable")
        out = replica.propose_from(requests, starts, release, caller, drafter)
        for r in requests:
            st = eagle.state.get(r.seq_id)
            if recovered[0] and st is not None:
                after.append((list(r.token_ids), st.base, st.n, st.out.clone()))
        return out

    server = DraftServer(serve, "127.0.0.1")
    try:
        remote = RemoteDrafter(EndpointHandle(server.address), timeout_s=10.0, caller="v", name="eagle3")
        remote.MIN_BACKOFF_S = remote.MAX_BACKOFF_S = 3600.0  # no probe of its own: the test sends it
        remote.SLOW_FACTOR = float("inf")  # the slow-call rule is test_a_hung_replica's: a stall of this process must not look like one
        engine = build_engine(cfg, {"eagle3": remote})
        prompt = "import os\nimport sys\n\ndef main("
        sid = engine.add_request(prompt, GREEDY, SpecParams("fixed", 4), "eagle3")
        out, step = [], 0
        while engine.has_work:
            step += 1
            down[0] = step in OUTAGE_STEPS
            if step == OUTAGE_STEPS.stop:  # a probe reaches the replica: the next step drafts
                remote._probe()
                recovered[0] = True
            for o in engine.step():
                out += o.token_ids
            if step == OUTAGE_STEPS.stop - 1:
                # kept, not dropped: the failed call's states and at least a token a step since
                assert remote.down and len(engine.seqs[sid].aux[1]) >= len(OUTAGE_STEPS)
        # lossless throughout (speculation off second: a prefix-cache hit would start the
        # head's window past the cached blocks)
        assert out == engine.generate([prompt], GREEDY, SpecParams("off"))[0]["token_ids"]
        assert remote.down is False and len(after) >= 2
        for tokens, base, n, state_out in after:
            # the head's cache reaches back to the prompt and up to the last token ...
            assert base == 0 and n == len(tokens) - 1
            # ... and holds what an uninterrupted run's would (fp32: chunking noise only)
            ref = full_context_state(engine.model, eagle.head, tokens)
            torch.testing.assert_close(state_out, ref.out, atol=2e-4, rtol=2e-4)
    finally:
        server.stop()
