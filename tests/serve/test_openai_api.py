"""The OpenAI-compatible HTTP API end to end: real Ray, Serve's HTTP proxy, the official
`openai` client.

Completions and chat, streamed and not, agree with each other and with the gRPC client;
n choices, stop strings, speculation on/off, log-probabilities (the target's, equal to the
in-process engine's and the same with speculation on and off), the error statuses; 64
concurrent streams all finish and leave no sequence behind.
"""

from __future__ import annotations

import pytest

from cluster.client import Client
from cluster.config import parse_config
from cluster.bench.chaos import run_concurrently, verifier_stats, wait_idle, wait_until

openai = pytest.importorskip("openai")
serve = pytest.importorskip("ray.serve")

APP, TINY = "oai", "oai-tiny"
KEY = "test-key"
PROMPT = "import os\nimport sys\n\ndef main("
MAX_TOKENS = 24
MODEL = "demo-target"


def _prefix(name: str) -> str:
    """The tiny app keeps the default route prefix: its API is at http://host:port/v1."""
    return "/" if name == TINY else f"/{name}"


def _config(ports, name: str, router: dict) -> dict:
    return {
        "placement": "disaggregated",
        "network": {"grpc_port": ports[0], "http_port": ports[1], "app_name": name, "route_prefix": _prefix(name)},
        "engine": {"max_num_seqs": 32, "max_model_len": 512, "max_waiting": 128},
        "router": router,
        "verifier": {"ray_actor_options": {"num_cpus": 1, "accelerator_type": "H100"}},
        "drafter": {"ray_actor_options": {"num_cpus": 1, "resources": {"head": 0.01}}},
    }


@pytest.fixture(scope="module")
def apps(serve_ports, demo_pair):
    """The main app (API keys on) and a tiny one (one sequence per client, no keys)."""
    from ray import serve

    from cluster.serve.launch import run_app

    run_app(parse_config(_config(serve_ports, APP, {"api_keys": [KEY], "per_client_concurrency": 128})))
    run_app(parse_config(_config(serve_ports, TINY, {"per_client_concurrency": 1})))
    yield serve_ports
    serve.delete(APP)
    serve.delete(TINY)


def _client(ports, app=APP, key=KEY):
    base = f"http://127.0.0.1:{ports[1]}{_prefix(app).rstrip('/')}/v1"
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(apps):
    return _client(apps)


def test_models(oai):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_equals_grpc_and_stream(oai, apps):
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.text
    assert r.usage.completion_tokens <= MAX_TOKENS and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    with Client(f"localhost:{apps[0]}", application=APP, api_key=KEY) as grpc_client:
        expect = grpc_client.generate(PROMPT, max_tokens=MAX_TOKENS)
    assert choice.text == expect.text
    assert r.usage.completion_tokens == len(expect.token_ids)
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_speculation_is_lossless_and_reported(oai):
    texts = {}
    for spec in ("off", 4):
        r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                   extra_body={"speculation": spec})
        texts[spec] = r.choices[0].text
        stats = r.choices[0].model_extra["spec"]
        assert set(stats) == {"drafted", "accepted", "acceptance_rate", "mean_accepted_len", "per_position"}
        assert (stats["drafted"] > 0) == (spec == 4)
    assert texts["off"] == texts[4]


def test_prompt_list_and_n(oai):
    r = oai.completions.create(model=MODEL, prompt=[PROMPT, "class Config:\n"], max_tokens=8, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text  # greedy
    assert r.choices[0].text != r.choices[2].text
    sampled = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, n=4, temperature=1.5, seed=7)
    assert len({c.text for c in sampled.choices}) > 1  # seed+j per choice


def test_stop_string(oai):
    full = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS).choices[0].text
    # two visible characters from past the first few tokens, so the stop lands mid-output
    stop = next(full[k:k + 2] for k in range(len(full) // 3, len(full) - 1) if not full[k:k + 2].isspace()
                and full[k:k + 2].strip() == full[k:k + 2])
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]


def test_chat_stream_and_usage(oai):
    system = "You write short, correct Python functions with docstrings and type hints, and nothing else."
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "def add(a, b):"}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=MAX_TOKENS)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    # the same prompt again on the one verifier replica: every full block but the last token's is cached
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert r.usage.prompt_tokens > 16 and cached == 16 * ((r.usage.prompt_tokens - 1) // 16)


@pytest.fixture(scope="module")
def reference(demo_pair):
    """The in-process engine's greedy tokens and log-probabilities, speculation off (its
    log-probabilities equal a Hugging Face forward pass: tests/engine/test_logprobs.py)."""
    from cluster.engine.sampling import SamplingParams
    from cluster.engine.scheduling.sequence import SpecParams
    from cluster.serve.build import build_engine

    engine = build_engine(parse_config({"engine": {"max_num_seqs": 4, "max_model_len": 512}}))
    return engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, logprobs=5), SpecParams("off"))[0]


def test_completion_logprobs_are_the_targets(oai, apps, reference):
    want = [lp.logprob for lp in reference["logprobs"]]
    for spec in ("off", 4):
        r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, logprobs=5,
                                   extra_body={"speculation": spec})
        lp = r.choices[0].logprobs
        assert r.choices[0].model_extra["spec"]["accepted"] > 0 or spec == "off"
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
        assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
        assert "".join(lp.tokens) == r.choices[0].text  # ASCII output: token texts join up
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert 5 <= len(top) <= 6  # k alternatives plus the chosen token (OpenAI: up to k+1)
            assert max(top, key=top.get) == token and top[token] == value  # greedy: the argmax
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, logprobs=2, stream=True))
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(want, abs=1e-4)
    offsets = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert offsets == sorted(offsets) and offsets[0] == 0
    plain = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert plain.choices[0].logprobs is None  # not asked, not computed
    with Client(f"localhost:{apps[0]}", application=APP, api_key=KEY) as grpc_client:
        g = grpc_client.generate(PROMPT, max_tokens=MAX_TOKENS, logprobs=1)
    assert [x.logprob for x in g.logprobs] == pytest.approx(want, abs=1e-4)
    assert [x.token_id for x in g.logprobs] == list(g.token_ids)


def test_chat_logprobs(oai):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, logprobs=True,
                                    top_logprobs=3, extra_body={"speculation": 4})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy: the argmax first
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6)
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert bytes(t.bytes).decode() == t.token
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, logprobs=True,
                                              stream=True, extra_body={"speculation": "off"}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    assert all(t.top_logprobs == [] for t in streamed)  # top_logprobs unset: none


def _status(call) -> int:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    body = info.value.body
    assert set(body) == {"message", "type", "param", "code"}  # the client unwraps "error"
    return info.value.status_code


def test_error_statuses(oai, apps):
    assert _status(lambda: oai.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)) == 400
    assert _status(lambda: oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10**6)) == 400
    assert _status(lambda: oai.completions.create(model=MODEL, prompt=PROMPT, echo=True)) == 400
    assert _status(lambda: oai.completions.create(model="no-such-model", prompt=PROMPT)) == 404
    chat = [{"role": "user", "content": "hi"}]
    assert _status(lambda: oai.chat.completions.create(model="no-such-model", messages=chat)) == 404
    assert _status(lambda: oai.completions.create(model=MODEL, prompt=PROMPT, logprobs=6)) == 400
    assert _status(lambda: oai.completions.create(model=MODEL, prompt=PROMPT, logprobs=-1)) == 400
    assert _status(lambda: oai.chat.completions.create(model=MODEL, messages=chat, logprobs=True,
                                                       top_logprobs=6)) == 400
    assert _status(lambda: oai.chat.completions.create(model=MODEL, messages=chat, top_logprobs=2)) == 400
    assert _status(lambda: _client(apps, key="wrong").completions.create(model=MODEL, prompt=PROMPT)) == 401
    assert _status(lambda: _client(apps, key="wrong").models.list()) == 401
    # two choices are two sequences; the tiny app allows one per client
    tiny = _client(apps, app=TINY, key="unused")
    assert tiny.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).choices[0].text
    assert _status(lambda: tiny.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2)) == 429


def test_64_concurrent_chat_streams(oai):
    messages = [{"role": "user", "content": "for i in range("}]

    def run(i):
        stream = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    results, errors = run_concurrently(run, 64, timeout_s=300)
    assert not errors, errors[:3]
    assert len(results) == 64 and len(set(results.values())) == 1 and results[0]
    stats = wait_idle(APP)
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0


def test_disconnect_cancels_sequence(oai):
    """A client that leaves mid-stream stops its sequence. The engine is paused first, so
    the sequence can end only by its abort (a running one can outrun the abort: how fast a
    disconnect crosses proxy, router and replica is a speed): the client reads the opening
    chunk, the request reaches the engine, the client leaves, and the engine drops it
    without a step or a token."""
    verifier = serve.get_deployment_handle("Verifier", APP)
    before = wait_idle(APP)
    verifier.pause.remote(True).result(timeout_s=30)
    try:
        stream = oai.chat.completions.create(model=MODEL, max_tokens=400, stream=True,
                                             messages=[{"role": "user", "content": PROMPT}])
        opening = next(iter(stream))
        assert opening.choices[0].delta.role == "assistant"
        wait_until(lambda: verifier_stats(APP)["waiting"] == 1, 30, "the request to reach the engine")
        stream.close()  # the client leaves mid-stream
        s = wait_until(lambda: (s := verifier_stats(APP))["waiting"] == 0 and s, 30, "the abort")
        assert s["aborted"] - before["aborted"] == 1 and s["finished"] == before["finished"]
        assert s["steps"] == before["steps"] and s["tokens"] == before["tokens"]
        assert s["running"] == 0 and s["kv_blocks_used"] == 0 and s["kv_slots_used"] == 0
    finally:
        verifier.pause.remote(False).result(timeout_s=30)
    wait_idle(APP)


def test_default_route_prefix_serves_the_api_at_v1(apps):
    """What every OpenAI client assumes: base_url http://host:port/v1."""
    assert _config(apps, TINY, {})["network"]["route_prefix"] == parse_config({}).network.route_prefix == "/"
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{apps[1]}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"speculation": "off"})
    assert r.usage.completion_tokens == 8 and r.choices[0].text
    chat = c.chat.completions.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": PROMPT}])
    assert chat.usage.completion_tokens == 8 and chat.choices[0].message.content


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/nowhere", 404), ("POST", "/v2/completions", 404), ("GET", "/v1/completions", 405),
    ("DELETE", "/v1/chat/completions", 405), ("PUT", "/v1/models", 405)])
def test_unknown_paths_and_methods_get_openai_errors(apps, method, path, status):
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{apps[1]}{path}", method=method, data=b"{}" if method != "GET" else None,
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == status
    error = json.loads(e.value.read())["error"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert path in error["message"] and error["code"] == status
