"""Cache-aware routing end to end: real Ray Serve, gRPC, a real Redis-protocol server.

Two verifier replicas; after one warm-up request per system prompt, every request with
that system prompt lands on the replica that cached it, and the replicas report prefix
hits. With the directory server killed requests still succeed (load-only routing);
restarted on the same port, verifiers republish and routing follows prefixes again.
A clean shutdown removes the replicas' directory entries at once.
"""

from __future__ import annotations

import asyncio
import glob
import json
import random
import time
from pathlib import Path

import pytest
import redis

from cluster.client import Client
from cluster.config import parse_config
from cluster.engine.scheduling.hashing import block_hashes, model_seed
from cluster.kvdir import make_directory
from cluster.kvdir.embedded import free_port, start_local_server

pytestmark = pytest.mark.slow

WORDS = ["object", "hook", "parse", "float", "int", "constant", "strict", "decoder", "encoder", "indent"]


def system_prompt(i: int) -> str:
    """~100 tokens, different from the first token on, so prompts share no block."""
    rng = random.Random(i)
    return f"# system {i}\n" + " ".join(rng.choice(WORDS) for _ in range(60)) + "\n"


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> str:
    """A random 2-layer Llama with a BPE tokenizer trained on the json package: routing
    does not care what the model says, only where its prefix blocks live."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny") / "target"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(sorted(glob.glob(str(Path(json.__file__).parent / "*.py"))),
              trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    eos = "<|endoftext|>"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=eos, pad_token=eos).save_pretrained(out)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 num_hidden_layers=2, intermediate_size=128, max_position_embeddings=1024,
                                 eos_token_id=0, bos_token_id=0, tie_word_embeddings=True)).save_pretrained(out)
    return str(out)


def wait_until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


class Probe:
    """Reads the directory the way the router does, from the test process."""

    def __init__(self, url: str, cfg, tokenizer):
        self.url, self.cfg, self.tokenizer = url, cfg, tokenizer

    def overlap(self, prompt: str) -> dict[str, int]:
        ids = self.tokenizer.encode(prompt)
        hashes = block_hashes(ids, self.cfg.engine.block_size, model_seed(self.cfg.models.target))

        async def ask():
            d = make_directory(self.url, self.cfg.name, self.cfg.models.target, self.cfg.kvdir.ttl_s)
            try:
                return await d.overlap(hashes)
            finally:
                await d.close()

        return asyncio.run(ask())


def test_requests_follow_their_prefix(serve_grpc, tiny_target):
    from ray import serve
    from transformers import AutoTokenizer

    from cluster.serve.launch import run_app

    port = free_port()
    url, stop = start_local_server(port=port)
    name = "spec-cache-routing"
    cfg = parse_config({
        "name": name,
        "models": {"target": tiny_target, "draft": None, "drafter": "none"},
        "engine": {"max_num_seqs": 8, "max_model_len": 512},
        "verifier": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}},
        "kvdir": {"url": url, "ttl_s": 3.0, "routing_stats_period_s": 0.5},
        "network": {"grpc_port": serve_grpc, "app_name": name, "route_prefix": f"/{name}"},
    })
    probe = Probe(url, cfg, AutoTokenizer.from_pretrained(tiny_target))
    run_app(cfg)
    client = Client(f"localhost:{serve_grpc}", application=name, timeout=30)

    def ask(prompt: str) -> str:
        r = client.generate(prompt, max_tokens=4, speculation="off")
        assert r.finish_reason and len(r.token_ids) >= 1
        return r.replica

    try:
        prompts = [system_prompt(i) for i in range(4)]
        home = {}
        for i, p in enumerate(prompts):
            home[i] = ask(p + "user 0")
            assert home[i]
        for i, p in enumerate(prompts):  # published within a flush (50 ms)
            wait_until(lambda p=p, i=i: probe.overlap(p + "user 1").get(home[i], 0) >= 4, 10, f"blocks of prompt {i}")

        for k in range(1, 4):
            for i, p in enumerate(prompts):
                assert ask(p + f"user {k} asks something else") == home[i], f"prompt {i}, request {k}"

        def hits():
            reps = {r.replica: r.prefix_hit_rate for r in client.stats().replicas}
            return all(reps.get(h, 0) > 0 for h in home.values()) and reps
        wait_until(hits, 10, "prefix hit rates in GetStats")

        # Directory down: routing falls back to load, nothing fails.
        stop(hard=True)
        for k in range(2):
            for p in prompts:
                assert ask(p + f"user {k} during the outage")

        # Back on the same port (empty): publishers resync their snapshots.
        url2, stop = start_local_server(port=port)
        assert url2 == url
        wait_until(lambda: all(probe.overlap(p + "x").get(home[i], 0) >= 4 for i, p in enumerate(prompts)),
                   15, "republished blocks after the restart")
        ask(prompts[0] + "wake the router's probe")
        time.sleep(1.2)  # the router probes a down directory once a second

        fresh = system_prompt(99)
        fresh_home = ask(fresh + "user 0")
        wait_until(lambda: probe.overlap(fresh + "user 1").get(fresh_home, 0) >= 4, 10, "blocks of the new prompt")
        for k in range(1, 4):
            assert ask(fresh + f"user {k}") == fresh_home
        for i, p in enumerate(prompts):
            held = probe.overlap(p + "again")
            assert held.get(ask(p + "again"), 0) == max(held.values()), f"prompt {i} after the restart"

        # Clean shutdown: each verifier's __del__ removes its entries. Expiry would empty the
        # block sets too, but only remove_replica also drops the replica from the registry.
        registry = f"sc:{{{cfg.name}:{cfg.models.target}}}:replicas"
        assert redis.Redis.from_url(url).zcard(registry) == 2
        serve.delete(name)
        assert redis.Redis.from_url(url).zcard(registry) == 0
        assert probe.overlap(prompts[0] + "x") == {}
    finally:
        client.close()
        if name in serve.status().applications:
            serve.delete(name)
        stop()
