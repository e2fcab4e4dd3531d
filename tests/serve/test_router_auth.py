"""Router pieces that need no Ray: where API keys come from, and bounded echoes."""

from __future__ import annotations

import pytest

from cluster.config import RouterSection
from cluster.serve.router import _api_keys, _short


def test_keys_from_config_and_env(monkeypatch):
    assert _api_keys(RouterSection()) == []
    monkeypatch.setenv("SC_KEYS", " k2 , k3,,")
    assert _api_keys(RouterSection(api_keys=["k1"], api_keys_env="SC_KEYS")) == ["k1", "k2", "k3"]


@pytest.mark.parametrize("value", [None, "", " , "])
def test_named_but_empty_env_refuses_to_start(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("SC_KEYS", raising=False)
    else:
        monkeypatch.setenv("SC_KEYS", value)
    with pytest.raises(RuntimeError, match="SC_KEYS"):
        _api_keys(RouterSection(api_keys=["k1"], api_keys_env="SC_KEYS"))


def test_echo_is_bounded():
    assert _short("gpt-5") == "'gpt-5'"
    assert _short("m" * 100_000).endswith("... (100000 chars)") and len(_short("m" * 100_000)) < 80
