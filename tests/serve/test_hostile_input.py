"""Hostile and broken input through the real gRPC endpoint (Serve proxy -> Router).

Every case gets a definite status and a message that names the problem; none leaves a
sequence behind. Raw cases go through a hand-built channel method whose serializer passes
bytes as they are, so the server sees exactly what a broken or hostile client would send.
The status table in docs/security.md is this file's CASES.
"""

from __future__ import annotations

import math
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.client import Client, build_request
from cluster.config import parse_config
from cluster.proto import generation_pb2 as pb
from cluster.bench.chaos import wait_idle

APP, KEY = "hostile", "k-test-1"
METHOD = "/speccluster.v1.Generation/Generate"
C = grpc.StatusCode
LIMITS = {"max_model_len": 256, "max_prompt_chars": 20000, "max_tokens_limit": 512, "gamma_max": 8}


@pytest.fixture(scope="module")
def address(serve_grpc, demo_pair):
    from ray import serve

    from cluster.serve.launch import run_app

    run_app(parse_config({
        "placement": "colocated",
        "engine": {"max_num_seqs": 8, "max_model_len": LIMITS["max_model_len"]},
        "router": {"api_keys": [KEY], "max_prompt_chars": LIMITS["max_prompt_chars"],
                   "max_tokens_limit": LIMITS["max_tokens_limit"], "default_max_tokens": 8},
        "verifier": {"ray_actor_options": {"num_cpus": 1}},
        "kvdir": {"url": None},
        "network": {"grpc_port": serve_grpc, "app_name": APP, "route_prefix": f"/{APP}"},
    }))
    yield f"localhost:{serve_grpc}"
    serve.delete(APP)


def meta(key: str | None = KEY) -> list[tuple[str, str]]:
    return [("application", APP)] + ([("authorization", f"Bearer {key}")] if key else [])


def raw_call(address: str, payload: bytes, metadata=None, method: str = METHOD):
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary(method, request_serializer=lambda b: b,
                              response_deserializer=pb.GenerateResponse.FromString)
        return call(payload, metadata=metadata or meta(), timeout=60)


def req(prompt: str = "x = ", **kw) -> bytes:
    """A GenerateRequest; fields the client helper would refuse are set on the proto."""
    mode, gamma = kw.pop("mode", None), kw.pop("gamma", None)
    r = build_request(prompt, **{"max_tokens": 4, **kw})
    if mode is not None:
        r.speculation.mode, r.speculation.gamma = mode, gamma or 0
    return r.SerializeToString()


FIXED = pb.Speculation.FIXED
# (id, payload, metadata key, expected code, a string the details must contain)
CASES = [
    ("empty prompt", req(""), KEY, C.INVALID_ARGUMENT, "prompt is empty"),
    ("prompt over max_prompt_chars", req("a" * 20001), KEY, C.INVALID_ARGUMENT, "the limit is 20000"),
    ("prompt over max_model_len tokens", req("def f(x):\n    return x\n" * 120), KEY, C.INVALID_ARGUMENT,
     "tokens; the limit is 255"),
    ("invalid UTF-8 in prompt", b"\x0a\x04\xff\xfe\xfd\xfc", KEY, C.INVALID_ARGUMENT, "bad UTF-8"),
    ("garbage bytes", b"\xff\xff\xff\xff\xff\xff", KEY, C.INVALID_ARGUMENT, "Wire format was corrupt"),
    ("garbage bytes, no API key", b"\xff\xff\xff\xff\xff\xff", None, C.UNAUTHENTICATED, "API key"),
    ("another message type (Speculation)", pb.Speculation(mode=FIXED, gamma=3).SerializeToString(), KEY,
     C.INVALID_ARGUMENT, "prompt is empty"),
    ("temperature NaN", req(temperature=math.nan), KEY, C.INVALID_ARGUMENT, "temperature"),
    ("temperature inf", req(temperature=math.inf), KEY, C.INVALID_ARGUMENT, "temperature"),
    ("temperature -1", req(temperature=-1.0), KEY, C.INVALID_ARGUMENT, "temperature"),
    ("temperature 1e9", req(temperature=1e9), KEY, C.INVALID_ARGUMENT, "temperature"),
    ("top_p 0", req(top_p=0.0), KEY, C.INVALID_ARGUMENT, "top_p"),
    ("top_p 1.5", req(top_p=1.5), KEY, C.INVALID_ARGUMENT, "top_p"),
    ("top_p NaN", req(top_p=math.nan), KEY, C.INVALID_ARGUMENT, "top_p"),
    ("top_k -5", req(top_k=-5), KEY, C.INVALID_ARGUMENT, "top_k"),
    ("seed -1", req(seed=-1), KEY, C.INVALID_ARGUMENT, "seed"),
    ("logprobs 6", req(logprobs=6), KEY, C.INVALID_ARGUMENT, "logprobs must be an integer in [0, 5]"),
    ("logprobs -1", req(logprobs=-1), KEY, C.INVALID_ARGUMENT, "logprobs must be an integer in [0, 5]"),
    ("max_tokens -1", req(max_tokens=-1), KEY, C.INVALID_ARGUMENT, "max_tokens must be in [1, 512]"),
    ("max_tokens 10^9", req(max_tokens=10**9), KEY, C.INVALID_ARGUMENT, "max_tokens must be in [1, 512]"),
    ("speculation mode 99", req(mode=99), KEY, C.INVALID_ARGUMENT, "unknown speculation mode 99"),
    ("fixed gamma 100", req(mode=FIXED, gamma=100), KEY, C.INVALID_ARGUMENT, "gamma must be in [0, 8]"),
    ("fixed gamma -1", req(mode=FIXED, gamma=-1), KEY, C.INVALID_ARGUMENT, "gamma must be in [0, 8]"),
    ("unknown drafter", pb.GenerateRequest(prompt="x", drafter="gpt-5").SerializeToString(), KEY,
     C.INVALID_ARGUMENT, "unknown drafter 'gpt-5'"),
    ("unknown model", req(model="llama-9000"), KEY, C.NOT_FOUND, "unknown model 'llama-9000'"),
    ("100k-char model name", req(model="m" * 100_000), KEY, C.NOT_FOUND, "(100000 chars)"),
    ("1000 stop strings", req(stop=[f"s{i}" for i in range(1000)]), KEY, C.INVALID_ARGUMENT, "at most 16 strings"),
    ("one 10k-char stop string", req(stop=["z" * 10_000]), KEY, C.INVALID_ARGUMENT, "at most 128 characters"),
    ("empty stop string", req(stop=[""]), KEY, C.INVALID_ARGUMENT, "non-empty strings"),
    ("1000-char request_id", req(request_id="r" * 1000), KEY, C.INVALID_ARGUMENT, "request_id has 1000"),
    ("5 MB message", req("a" * 5_000_000), KEY, C.RESOURCE_EXHAUSTED, "larger than max"),
    ("no API key", req(), None, C.UNAUTHENTICATED, "missing or invalid API key"),
    ("wrong API key", req(), "k-test-2", C.UNAUTHENTICATED, "missing or invalid API key"),
    ("API key prefix", req(), KEY[:-1], C.UNAUTHENTICATED, "missing or invalid API key"),
]


@pytest.mark.parametrize("payload,key,code,needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_with_status_and_message(address, payload, key, code, needle):
    with pytest.raises(grpc.RpcError) as e:
        raw_call(address, payload, meta(key))
    assert e.value.code() == code, e.value.details()
    assert needle in e.value.details()
    assert len(e.value.details()) < 400  # nothing echoed back at length


def test_other_refusals(address):
    # a wrong scheme is no key; an unknown method never reaches the router
    with pytest.raises(grpc.RpcError) as e:
        raw_call(address, req(), [("application", APP), ("authorization", f"Basic {KEY}")])
    assert e.value.code() == C.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        raw_call(address, req(), method="/speccluster.v1.Generation/Nope")
    assert e.value.code() == C.UNIMPLEMENTED
    # a refused stream ends with the status before any chunk
    with Client(address, application=APP, api_key=KEY) as c, pytest.raises(grpc.RpcError) as e:
        list(c.generate_stream("x", temperature=math.nan))
    assert e.value.code() == C.INVALID_ARGUMENT and "temperature" in e.value.details()


def test_every_method_but_health_needs_the_key(address):
    """GetModelInfo and GetStats (replica ids, load, acceptance) are refused without a key;
    health stays open for probes and says NOT_FOUND for a service it does not serve."""
    with Client(address, application=APP) as anon:
        for call in (anon.model_info, anon.stats):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == C.UNAUTHENTICATED and "API key" in e.value.details()
        assert anon.health() == "SERVING"
        assert anon.health("speccluster.v1.Generation") == "SERVING"
        with pytest.raises(grpc.RpcError) as e:
            anon.health("no.such.Service")
        assert e.value.code() == C.NOT_FOUND
    with Client(address, application=APP, api_key=KEY) as c:
        assert c.model_info().max_model_len == LIMITS["max_model_len"]
        # a replica's report older than FRESH_S (2 s) drops it: a loaded host may be late once
        deadline = time.monotonic() + 10
        while len(c.stats().replicas) != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(c.stats().replicas) == 1


def test_odd_but_valid_requests_are_served(address):
    """Wire-compatible bytes are a valid request: protobuf carries no type name."""
    from grpc_health.v1 import health_pb2

    cases = [health_pb2.HealthCheckRequest(service="import os").SerializeToString(),  # field 1 = prompt
             req("\x00" * 10), req("x", top_k=2**31 - 1, temperature=1.0, seed=7), req("x", max_tokens=0),
             req("x", mode=pb.Speculation.OFF, gamma=-3),  # gamma is read only when FIXED
             b"\x0a\x01x" + b"\xf8\x07\x01"]  # an unknown field (127) is skipped
    for payload in cases:
        r = raw_call(address, payload)
        assert r.finish_reason in ("length", "eos", "stop") and 1 <= len(r.token_ids) <= 8
    with grpc.insecure_channel(address) as ch:  # the auth scheme is case-insensitive
        call = ch.unary_unary(METHOD, request_serializer=lambda b: b, response_deserializer=pb.GenerateResponse.FromString)
        assert call(req(), metadata=[("application", APP), ("authorization", f"bearer {KEY}")], timeout=60).token_ids
    wait_idle(APP)


OK_REASONS = ("length", "eos", "stop")
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 0.7, 1.0]))
requests = st.fixed_dictionaries({
    "prompt": st.one_of(st.text(max_size=40), st.sampled_from(["def f(", "import os\n", "x" * 300])),
    "max_tokens": st.one_of(st.integers(-3, 6), st.sampled_from([600, 2**31 - 1])),
    "temperature": st.one_of(st.none(), floats),
    "top_p": st.one_of(st.none(), floats),
    "top_k": st.one_of(st.none(), st.integers(-2**31, 2**31 - 1), st.integers(0, 50)),
    "seed": st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)),
    "stop": st.lists(st.text(max_size=6), max_size=20),
    "mode": st.sampled_from([0, 1, 2, 3, 7, -1]),
    "gamma": st.integers(-3, 12),
    "drafter": st.sampled_from(["", "model", "ngram", "bogus"]),
    "model": st.sampled_from(["", "default", "nope"]),
})


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(r=requests)
def test_random_requests_never_break_the_server(address, r):
    r = dict(r)
    mode, gamma = r.pop("mode"), r.pop("gamma")
    msg = build_request(r.pop("prompt"), **{k: v for k, v in r.items() if k not in ("drafter",)})
    msg.drafter, msg.speculation.mode, msg.speculation.gamma = r["drafter"], mode, gamma
    try:
        out = raw_call(address, msg.SerializeToString())
    except grpc.RpcError as e:
        assert e.code() in (C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED, C.NOT_FOUND), (e.code(), e.details())
        assert e.details() and len(e.details()) < 400
        return
    max_tokens = msg.max_tokens or 8
    assert out.finish_reason in OK_REASONS and 1 <= len(out.token_ids) <= max_tokens
    assert out.prompt_tokens >= 1 and out.replica


def test_nothing_left_behind(address):
    """Runs after the table and the property test (file order)."""
    s = wait_idle(APP)
    assert s["kv_slots_used"] == 0 and s["kv_blocks_used"] == 0
