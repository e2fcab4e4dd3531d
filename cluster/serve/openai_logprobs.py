"""Log-probabilities in OpenAI's two response shapes, from the engine's `TokenLogprob`s
(cluster.engine.logprobs: the target's raw distribution at each emitted token's position).

/v1/completions (`logprobs: k`, 0..5): `{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}`, each top_logprobs entry a {token: logprob} dict of the k most likely tokens
plus the chosen one (OpenAI: "up to logprobs+1 elements").
/v1/chat/completions (`logprobs: true`, `top_logprobs: k`): `{"content": [{"token",
"logprob", "bytes", "top_logprobs": [...k...]}], "refusal": null}`.

A token's text is the tokenizer's decoding of that token alone, and its bytes that text's
UTF-8 (as vLLM does): a token holding part of a multi-byte character reads as U+FFFD.
Streamed, each chunk carries the log-probabilities of the tokens it brings.
"""

from __future__ import annotations

MAX_TOP = 5  # what OpenAI's completions API allows; chat's top_logprobs is held to the same


class Formatter:
    """Turns TokenLogprobs into one endpoint's shape; caches token texts (the same few
    thousand ids recur)."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        t = self._text.get(token_id)
        if t is None:
            t = self._text[token_id] = self.tokenizer.decode([token_id])
        return t

    def __call__(self, lps: list, offset: int = 0) -> dict:
        """`offset`: characters of the choice's text before these tokens (completions' text_offset)."""
        return self._chat(lps) if self.chat else self._completion(lps, offset)

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}

    def _chat(self, lps: list) -> dict:
        content = [{**self._entry(lp.token_id, lp.logprob), "top_logprobs": [self._entry(i, v) for i, v in lp.top]}
                   for lp in lps]
        return {"content": content, "refusal": None}

    def _completion(self, lps: list, offset: int) -> dict:
        tokens, offsets = [], []
        for lp in lps:
            offsets.append(offset)
            tokens.append(self.text(lp.token_id))
            offset += len(tokens[-1])
        tops = [{**{self.text(i): v for i, v in lp.top}, self.text(lp.token_id): lp.logprob} for lp in lps]
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": tops,
                "text_offset": offsets}
