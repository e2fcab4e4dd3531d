"""Admission without Ray or grpc: keys, limits, validation and tokenization, each refusal
with its ErrorKind and a message that names the problem."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys

import pytest

from cluster.config import RouterSection, parse_config
from cluster.engine.drafters.registry import DRAFTERS
from cluster.serve.admission import (MAX_REQUEST_ID, Admission, AdmissionError, GenerateInput, api_keys,
                                     bearer_token, short)
from cluster.serve.calls import ErrorKind, GenerateCall

MAX_MODEL_LEN = 64
TARGET = "demo-target"


class CharTokenizer:
    """One token per character: token counts are the prompt's length."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text]


def make(router: dict | None = None, drafters: list[str] | None = None,
         info_error: Exception | None = None) -> Admission:
    cfg = parse_config({"models": {"target": TARGET}, "router": router or {}})

    async def model_info() -> dict:
        if info_error is not None:
            raise info_error
        info = {"max_model_len": MAX_MODEL_LEN}
        if drafters is not None:
            info["drafters"] = drafters
        return info

    return Admission(cfg, CharTokenizer(), model_info)


def admit(adm: Admission, prompt: str = "x = ", **kw) -> GenerateCall:
    return asyncio.run(adm.admit(GenerateInput(prompt, **kw)))


def refused(kind: ErrorKind, fn, *args, **kw) -> str:
    with pytest.raises(AdmissionError) as e:
        fn(*args, **kw)
    assert e.value.kind is kind, (e.value.kind, e.value.message)
    assert len(e.value.message) < 400
    return e.value.message


# ---- keys ------------------------------------------------------------------------------
def test_keys_from_config_and_env(monkeypatch):
    assert api_keys(RouterSection()) == []
    monkeypatch.setenv("SC_KEYS", " k2 , k3,,")
    assert api_keys(RouterSection(api_keys=["k1"], api_keys_env="SC_KEYS")) == ["k1", "k2", "k3"]


@pytest.mark.parametrize("value", [None, "", " , "])
def test_named_but_empty_env_refuses_to_start(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("SC_KEYS", raising=False)
    else:
        monkeypatch.setenv("SC_KEYS", value)
    with pytest.raises(RuntimeError, match="SC_KEYS"):
        api_keys(RouterSection(api_keys=["k1"], api_keys_env="SC_KEYS"))
    with pytest.raises(RuntimeError, match="SC_KEYS"):
        make({"api_keys": ["k1"], "api_keys_env": "SC_KEYS"})


def test_bearer_token():
    assert bearer_token("Bearer k1") == "k1" and bearer_token("bEaReR k1") == "k1"
    assert bearer_token("Basic k1") is None and bearer_token(None) is None and bearer_token("") is None
    assert bearer_token("Bearer ") == ""


@pytest.mark.parametrize("token", [None, "", "k-wrong", "k-tes", "k-test-1x", "K-TEST-1"])
def test_bad_key_is_unauthenticated(token):
    adm = make({"api_keys": ["k-test-1"]})
    assert "API key" in refused(ErrorKind.UNAUTHENTICATED, adm.authenticate, token, "ipv4:10.0.0.7:5")


def test_good_key_names_the_client(monkeypatch):
    monkeypatch.setenv("SC_KEYS", "k3")
    adm = make({"api_keys": ["k1", "k2"], "api_keys_env": "SC_KEYS"})
    assert adm.authenticate("k2", "ipv4:10.0.0.7:5") == "key-1"
    assert adm.authenticate("k3", "") == "key-2"  # keys from the env count too


def test_without_keys_clients_are_peer_hosts():
    adm = make()
    assert adm.authenticate(None, "ipv4:10.0.0.7:51234") == "ipv4:10.0.0.7"
    assert adm.authenticate("anything", "ipv6:[::1]:6000") == "ipv6:[::1]"
    assert adm.authenticate(None, "") == "anonymous"


# ---- limits ----------------------------------------------------------------------------
def test_per_client_limit_is_exhausted_and_released():
    adm = make({"per_client_concurrency": 2})
    with adm.slot("a"), adm.slot("a"):
        assert "client concurrency limit reached (2)" in refused(ErrorKind.EXHAUSTED, adm.slot("a").__enter__)
        with adm.slot("b"):  # another client has its own places
            assert adm.inflight == 3
    assert adm.inflight == 0 and not adm.per_client  # a refusal changed nothing
    with adm.slot("a"), adm.slot("a"):  # both places came back
        pass


def test_router_capacity_is_exhausted_and_released():
    adm = make({"max_inflight": 2})
    with adm.slot("a"), adm.slot("b"):
        assert "router at capacity (2 requests in flight)" in refused(ErrorKind.EXHAUSTED, adm.slot("c").__enter__)
    assert adm.inflight == 0 and not adm.per_client
    with adm.slot("c"), adm.slot("c"):  # both places came back
        pass


def test_router_replicas_share_a_clients_limit():
    """Three routers with a limit of 7: each admits 2 of a client's requests, 6 in all."""
    routers = [make({"per_client_concurrency": 7, "num_replicas": 3}) for _ in range(3)]
    held = []
    for adm in routers:
        held += [adm.slot("a"), adm.slot("a")]
    for slot in held:
        slot.__enter__()
    for adm in routers:
        assert "2 in each of 3 routers" in refused(ErrorKind.EXHAUSTED, adm.slot("a").__enter__)
    assert sum(adm.per_client["a"] for adm in routers) == 6 <= 7
    with routers[0].slot("b"):  # another client has its own places
        pass


def test_slot_is_released_when_the_body_raises():
    adm = make({"per_client_concurrency": 1})
    with pytest.raises(ValueError), adm.slot("a"):
        raise ValueError("the verifier call broke")
    assert adm.inflight == 0 and not adm.per_client
    with adm.slot("a"):
        assert adm.per_client["a"] == 1


def test_slot_is_released_when_a_stream_is_closed_early():
    adm = make({"per_client_concurrency": 1})

    async def outputs():
        with adm.slot("a"):
            for i in range(10):
                yield i

    async def take_one():
        gen = outputs()
        assert await gen.__anext__() == 0 and adm.inflight == 1
        await gen.aclose()  # the client left mid-stream

    asyncio.run(take_one())
    assert adm.inflight == 0 and not adm.per_client


def test_router_capacity_is_exhausted():
    adm = make({"max_inflight": 2})
    with adm.slot("a"), adm.slot("b"):
        assert "router at capacity (2 requests in flight)" in refused(ErrorKind.EXHAUSTED, adm.slot("c").__enter__)
    with adm.slot("c"):
        assert adm.inflight == 1


# ---- validation and tokenization -------------------------------------------------------
def test_admitted_call_is_tokenized_with_defaults():
    call = admit(make({"default_max_tokens": 7}), "abc", request_id="r1", drafter="")
    assert call.prompt_ids == [97, 98, 99]
    p = call.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (7, 0.0, 1.0, 0, None, [])
    assert (call.spec.mode, call.drafter) == ("auto", None)
    assert call.request_id.startswith("r1-") and call.request_id != admit(make(), "abc", request_id="r1").request_id
    call = admit(make(), "abc", temperature=0.5, top_p=0.9, top_k=3, seed=11, stop=["\n"], spec_mode="fixed",
                 gamma=2, drafter="ngram", model="default")
    assert (call.params.temperature, call.params.top_p, call.params.top_k, call.params.seed) == (0.5, 0.9, 3, 11)
    assert (call.params.stop, call.spec.mode, call.spec.gamma, call.drafter) == (["\n"], "fixed", 2, "ngram")
    assert call.request_id.startswith("req-")


LONG = "y" * MAX_MODEL_LEN
INVALID = [  # (input fields, router limits, what the message must name)
    ({"prompt": ""}, {}, "prompt is empty"),
    ({"prompt": "a" * 101}, {"max_prompt_chars": 100}, "prompt has 101 characters; the limit is 100"),
    ({"prompt": LONG}, {}, f"prompt has {MAX_MODEL_LEN} tokens; the limit is {MAX_MODEL_LEN - 1}"),
    ({"max_tokens": -1}, {"max_tokens_limit": 512}, "max_tokens must be in [1, 512]"),
    ({"max_tokens": 513}, {"max_tokens_limit": 512}, "max_tokens must be in [1, 512]"),
    ({"temperature": math.nan}, {}, "temperature"),
    ({"temperature": -1.0}, {}, "temperature"),
    ({"top_p": 0.0}, {}, "top_p"),
    ({"top_k": -5}, {}, "top_k"),
    ({"seed": -1}, {}, "seed"),
    ({"stop": [""]}, {}, "stop"),
    ({"stop": [f"s{i}" for i in range(100)]}, {}, "stop"),
    ({"spec_mode": "99"}, {}, "unknown speculation mode 99"),
    ({"spec_mode": "fixed", "gamma": 100}, {}, "gamma must be in [0, 8]"),
    ({"spec_mode": "fixed", "gamma": -1}, {}, "gamma must be in [0, 8]"),
    ({"request_id": "r" * (MAX_REQUEST_ID + 1)}, {}, f"request_id has {MAX_REQUEST_ID + 1} characters"),
]


@pytest.mark.parametrize("fields,router,needle", INVALID, ids=[c[2][:40] for c in INVALID])
def test_invalid_input_names_the_field(fields, router, needle):
    fields = {"prompt": "x = ", **fields}
    msg = refused(ErrorKind.INVALID, admit, make(router), **fields)
    assert needle in msg


def test_gamma_and_mode_are_read_only_where_they_apply():
    assert admit(make(), spec_mode="off", gamma=-3).spec.mode == "off"
    assert admit(make(), prompt="y" * (MAX_MODEL_LEN - 1)).prompt_ids  # one under the limit


def test_unknown_drafter_is_invalid():
    msg = refused(ErrorKind.INVALID, admit, make(), drafter="gpt-5")
    assert "unknown drafter 'gpt-5'" in msg and all(name in msg for name in DRAFTERS)
    assert len(refused(ErrorKind.INVALID, admit, make(), drafter="d" * 100_000)) < 200


def test_drafters_the_deployment_lacks_are_invalid():
    adm = make(drafters=["model", "ngram"])
    assert admit(adm, drafter="ngram").drafter == "ngram"
    msg = refused(ErrorKind.INVALID, admit, adm, drafter="medusa")
    assert "unknown drafter 'medusa'" in msg and "model, ngram" in msg


def test_unknown_model_is_not_found():
    adm = make()
    assert f"unknown model 'llama-9000'; this cluster serves {TARGET!r}" in \
        refused(ErrorKind.NOT_FOUND, admit, adm, model="llama-9000")
    assert "(100000 chars)" in refused(ErrorKind.NOT_FOUND, admit, adm, model="m" * 100_000)
    assert admit(adm, model=TARGET).prompt_ids and admit(adm, model="default").prompt_ids


def test_checks_run_in_order():
    """The first problem wins, cheapest checks first: an ingress's status codes for a
    request with several problems stay what they were."""
    adm = make()
    refused(ErrorKind.NOT_FOUND, admit, adm, prompt="", model="nope", temperature=math.nan)
    assert refused(ErrorKind.INVALID, admit, adm, prompt="", temperature=math.nan) == "prompt is empty"
    assert "max_tokens" in refused(ErrorKind.INVALID, admit, adm, max_tokens=-1, spec_mode="99")
    assert "speculation mode" in refused(ErrorKind.INVALID, admit, adm, spec_mode="99", temperature=math.nan)


def test_no_verifier_yet_is_unavailable():
    adm = make(info_error=TimeoutError("no replica"))
    assert refused(ErrorKind.UNAVAILABLE, admit, adm) == "verifier unavailable: TimeoutError"


def test_echo_is_bounded():
    assert short("gpt-5") == "'gpt-5'"
    assert short("m" * 100_000).endswith("... (100000 chars)") and len(short("m" * 100_000)) < 80


def test_imports_neither_ray_nor_grpc():
    code = ("import sys, cluster.serve.admission, cluster.serve.calls; "
            "print(sorted(m for m in ('ray', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
