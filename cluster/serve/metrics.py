"""Verifier metrics through Ray's metrics API: they reach the Ray dashboard and Prometheus
(as `ray_<name>`, counters with `_total`). One `VerifierMetrics` per replica, fed from the
engine's step hook.

The speculation counters carry vLLM v1's names and meaning (vllm/v1/spec_decode/metrics.py)
with Ray's prefix in place of `vllm:`, which Ray metric names cannot hold:
`vllm:spec_decode_num_drafts_total` is `ray_spec_decode_num_drafts_total` here, with the
same `model_name` label and `position` on the per-position one (our `replica` where vLLM
has `engine`), so vLLM's PromQL works with the prefix swapped. vLLM's per-position rate is
accepted_per_pos / num_drafts, right for its fixed K; with gamma chosen per step here, a
position is not drafted every step, so `spec_decode_num_draft_tokens_per_pos` (ours) gives
the denominator. Everything else is ours and named `spec_*`."""

from __future__ import annotations

from ray.util import metrics

MS_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
TOKEN_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


class VerifierMetrics:
    def __init__(self, replica: str, model_name: str):
        tags = ("replica", "model_name")
        self.drafts = metrics.Counter("spec_decode_num_drafts", "Number of spec decoding drafts (a sequence "
                                      "drafting in a verify step)", tag_keys=tags)
        self.drafted = metrics.Counter("spec_decode_num_draft_tokens", "Number of draft tokens.", tag_keys=tags)
        self.accepted = metrics.Counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                        tag_keys=tags)
        self.pos_accepted = metrics.Counter("spec_decode_num_accepted_tokens_per_pos",
                                            "Accepted tokens per draft position.", tag_keys=tags + ("position",))
        self.pos_proposed = metrics.Counter("spec_decode_num_draft_tokens_per_pos",
                                            "Draft tokens per draft position.", tag_keys=tags + ("position",))
        self.gamma = metrics.Gauge("spec_gamma", "Gamma of the last verify step", tag_keys=tags)
        self.on = metrics.Gauge("spec_speculation_on", "1 while speculation is on (gamma > 0)", tag_keys=tags)
        self.batch_tokens = metrics.Histogram("spec_verify_batch_tokens", "Verify tokens per step",
                                              boundaries=TOKEN_BUCKETS, tag_keys=tags)
        self.ttft = metrics.Histogram("spec_ttft_ms", "Time to first token (ms)", boundaries=MS_BUCKETS, tag_keys=tags)
        self.itl = metrics.Histogram("spec_itl_ms", "Inter-token latency (ms)", boundaries=MS_BUCKETS, tag_keys=tags)
        self.prefix_hit = metrics.Gauge("spec_prefix_hit_ratio", "Prefix-cache block hit ratio", tag_keys=tags)
        self.running = metrics.Gauge("spec_running_sequences", "Sequences in the batch", tag_keys=tags)
        self.kv_total = metrics.Gauge("spec_kv_blocks_total", "Blocks in the paged KV pool", tag_keys=tags)
        self.kv_used = metrics.Gauge("spec_kv_blocks_used", "KV blocks held by live sequences", tag_keys=tags)
        self.kv_cached = metrics.Gauge("spec_kv_blocks_cached", "Free KV blocks still holding a reusable prefix",
                                       tag_keys=tags)
        self.preemptions = metrics.Counter("spec_preemptions", "Sequences preempted for want of KV blocks "
                                           "(recomputed later)", tag_keys=tags)
        # drafting: next-step drafts asked for during a verify pass and then used or dropped
        # (how often a drafter working ahead pays), and draft calls that failed (the rows
        # decoded without drafts that step)
        self.ahead_hits = metrics.Counter("spec_draft_ahead_hits", "Rows whose look-ahead draft, asked for "
                                          "during the previous verify pass, was used", tag_keys=tags)
        self.ahead_misses = metrics.Counter("spec_draft_ahead_misses", "Rows whose look-ahead draft was dropped "
                                            "(a draft rejected or another bonus token)", tag_keys=tags)
        self.draft_failures = metrics.Counter("spec_draft_failures", "Draft calls that failed (their rows "
                                              "decoded without drafts that step)", tag_keys=tags)
        # Engine.stats() key -> counter fed with its growth since the last report
        self.totals = {"preemptions": self.preemptions, "ahead_hits": self.ahead_hits,
                       "ahead_misses": self.ahead_misses, "draft_failures": self.draft_failures}
        self.last = dict.fromkeys(self.totals, 0)  # the engine's counts when last reported
        self.tags = {"replica": replica, "model_name": model_name}
        for m in (self.drafts, self.drafted, self.accepted, self.gamma, self.on, self.batch_tokens, self.ttft, self.itl,
                  self.prefix_hit, self.running, self.kv_total, self.kv_used, self.kv_cached, *self.totals.values()):
            m.set_default_tags(self.tags)

    def step(self, obs) -> None:
        """After each verify pass (engine.on_verify)."""
        if obs.drafted:
            self.drafted.inc(obs.drafted)
            self.drafts.inc(obs.proposed_per_position[0])  # rows with at least one draft token
        acc = sum(obs.accepted_per_position)
        if acc:
            self.accepted.inc(acc)
        for j, (p, a) in enumerate(zip(obs.proposed_per_position, obs.accepted_per_position)):
            tags = {**self.tags, "position": str(j)}
            self.pos_proposed.inc(p, tags)
            if a:
                self.pos_accepted.inc(a, tags)
        self.gamma.set(obs.gamma)
        self.on.set(1 if obs.gamma > 0 else 0)
        self.batch_tokens.observe(obs.verify_tokens)
        self.running.set(obs.batch_size)

    def finished(self, timing: dict, itl_ms: list[float], prefix_hit_rate: float) -> None:
        self.ttft.observe(timing["ttft_ms"])
        for x in itl_ms:
            self.itl.observe(x)
        self.prefix_hit.set(prefix_hit_rate)

    def report(self, stats: dict) -> None:
        """The KV pool's figures and the counts kept by the engine, from Engine.stats(), with
        each stats report (every second, idle or not: a step-time hook would leave the last
        busy figures up once idle, and counting cached blocks walks the free list)."""
        self.kv_total.set(stats["kv_blocks_total"])
        self.kv_used.set(stats["kv_blocks_used"])
        self.kv_cached.set(stats["kv_blocks_cached"])
        for key, counter in self.totals.items():
            n = stats.get(key, 0)
            if n > self.last[key]:
                counter.inc(n - self.last[key])
            self.last[key] = n
