"""The OpenAI-compatible HTTP API: GET /v1/models, POST /v1/completions and
/v1/chat/completions, on Serve's own HTTP proxy.

Serve gives an application one ingress deployment, which both its gRPC and its HTTP proxy
call; so these routes are mixed into the Router (`OpenAIRoutes`, served with
`@serve.ingress(api)` in cluster/serve/router.py) rather than living in a second
deployment. Both protocols then share one `Admission`: the same API keys, the same
in-flight limits and the same verifier handle. Requests are decoded here into admission's
`GenerateInput`; failures leave in OpenAI's error shape with an HTTP status from `ErrorKind`.

Extra body fields: `speculation` ("off", "auto" or an int K: K draft tokens a step) and
`drafter` (a drafter registry name). Each choice carries a `spec` object (drafted,
accepted, acceptance_rate, mean_accepted_len, per_position) from its sequence's stats.
Log-probabilities (the target's, see cluster.serve.openai_logprobs) when the body asks.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
import uuid
from contextlib import ExitStack, aclosing
from dataclasses import replace

from fastapi import FastAPI, Request
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, StreamingResponse

from cluster.serve.admission import AdmissionError, GenerateInput, bearer_token
from cluster.serve.calls import ErrorKind, RequestError, internal_error, stream_outputs
from cluster.serve.openai_logprobs import MAX_TOP, Formatter

api = FastAPI(title="spec-cluster", docs_url=None, redoc_url=None, openapi_url=None)
MAX_N = 16  # choices per request: each is a sequence of its own on the verifier
STATUS = {ErrorKind.INVALID: 400, ErrorKind.UNAUTHENTICATED: 401, ErrorKind.NOT_FOUND: 404,
          ErrorKind.EXHAUSTED: 429, ErrorKind.UNAVAILABLE: 503, ErrorKind.DEADLINE: 504,
          ErrorKind.CANCELLED: 499, ErrorKind.INTERNAL: 500}
TYPES = {ErrorKind.INVALID: "invalid_request_error", ErrorKind.UNAUTHENTICATED: "authentication_error",
         ErrorKind.NOT_FOUND: "not_found_error", ErrorKind.EXHAUSTED: "rate_limit_error",
         ErrorKind.UNAVAILABLE: "service_unavailable", ErrorKind.DEADLINE: "timeout",
         ErrorKind.CANCELLED: "cancelled", ErrorKind.INTERNAL: "server_error"}
SPEC_KEYS = ("drafted", "accepted", "acceptance_rate", "mean_accepted_len", "per_position")
# fields this server does not implement, and the values that ask for nothing
UNSUPPORTED = {"echo": (None, False), "suffix": (None, ""), "best_of": (None, 1), "tools": (None, []),
               "functions": (None, [])}
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # engine's reasons -> OpenAI's


class BadField(AdmissionError):
    """An invalid body field; `param` names it in the error (OpenAI's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(ErrorKind.INVALID, message)
        self.param = param


def error_body(e: RequestError) -> dict:
    return {"error": {"message": e.message, "type": TYPES[e.kind], "param": getattr(e, "param", None),
                      "code": e.kind.value}}


def error_response(e: Exception) -> JSONResponse:
    error = e if isinstance(e, RequestError) else internal_error(e, "openai api")
    return JSONResponse(error_body(error), status_code=STATUS[error.kind])


@api.exception_handler(StarletteHTTPException)
async def _routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """An unknown path or method, in OpenAI's error shape (FastAPI's own is {"detail": ...})."""
    what = {404: ("no such route", "not_found_error"), 405: ("method not allowed", "invalid_request_error")}
    message, kind = what.get(exc.status_code, (str(exc.detail), "invalid_request_error"))
    body = {"error": {"message": f"{request.method} {request.url.path}: {message}", "type": kind, "param": None,
                      "code": exc.status_code}}
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


# ---- decoding the body -----------------------------------------------------------------
def _get(body: dict, name: str, types: tuple, default=None):
    """body[name] if it has one of `types` (None: the default); bool is not a number."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise BadField(name, f"{name} must be {' or '.join(t.__name__ for t in types)}, got {type(value).__name__}")
    return value


def _strings(body: dict, name: str) -> list[str]:
    value = _get(body, name, (str, list), [])
    value = [value] if isinstance(value, str) else value
    if not all(isinstance(s, str) for s in value):
        raise BadField(name, f"{name} must be a string or a list of strings")
    return value


def _speculation(body: dict) -> tuple[str, int]:
    value = _get(body, "speculation", (str, int), "auto")
    if isinstance(value, int):
        return "fixed", value
    return value, 0  # an unknown mode goes on to admission, which names it


def _top(body: dict, name: str) -> int | None:
    value = _get(body, name, (int,))
    if value is not None and not 0 <= value <= MAX_TOP:
        raise BadField(name, f"{name} must be in [0, {MAX_TOP}], got {value}")
    return value


def logprobs_wanted(body: dict, chat: bool) -> int | None:
    """Alternatives per token the body asks for (completions: `logprobs: k`; chat:
    `logprobs: true` and `top_logprobs: k`); None: no log-probabilities."""
    if not chat:
        return _top(body, "logprobs")
    want, top = _get(body, "logprobs", (bool,), False), _top(body, "top_logprobs")
    if top is not None and not want:  # OpenAI and vLLM refuse it too
        raise BadField("top_logprobs", "top_logprobs needs logprobs: true")
    return (top or 0) if want else None


def sampling_input(body: dict, prompt: str, chat: bool) -> GenerateInput:
    """The fields every generate request shares (chat has max_completion_tokens, the newer
    name, before max_tokens; and its own logprobs fields)."""
    max_tokens_names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name, harmless in UNSUPPORTED.items():
        if body.get(name) not in harmless:
            raise BadField(name, f"{name} is not supported")
    max_tokens = 0
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens = _get(body, name, (int,))
            if max_tokens < 1:  # admission reads 0 as "the default"; OpenAI refuses it
                raise BadField(name, f"{name} must be at least 1, got {max_tokens}")
            break
    mode, gamma = _speculation(body)
    return GenerateInput(
        prompt=prompt, max_tokens=max_tokens, temperature=_get(body, "temperature", (int, float)),
        top_p=_get(body, "top_p", (int, float)), seed=_get(body, "seed", (int,)), stop=_strings(body, "stop"),
        spec_mode=mode, gamma=gamma, drafter=_get(body, "drafter", (str,), ""), model=_get(body, "model", (str,), ""),
        logprobs=logprobs_wanted(body, chat))


def chat_prompt(tokenizer, body: dict) -> str:
    """The messages rendered with the model's chat template, ending in an open assistant turn."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadField("messages", "messages must be a non-empty list")
    rendered = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadField("messages", "each message needs a string role")
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: only text ones make sense here
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise BadField("messages", "only text content parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise BadField("messages", "message content must be a string or a list of text parts")
        rendered.append({"role": m["role"], "content": content})
    if not getattr(tokenizer, "chat_template", None):
        raise BadField("messages", "this model has no chat template; use /v1/completions")
    return tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)


def spec_of(out) -> dict:
    return {k: out.stats["spec"][k] for k in SPEC_KEYS}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class OpenAIRoutes:
    """The HTTP routes, mixed into the Router: they use its `admission`, `verifier`, `cfg`
    and `_model_info`."""

    @api.get("/v1/models")
    async def list_models(self, request: Request):
        try:
            self._client(request)
            info = await self._model_info()
        except Exception as e:  # noqa: BLE001 - never a raw traceback to the client
            return error_response(e)
        model = {"id": self.cfg.models.target, "object": "model", "created": 0, "owned_by": "spec-cluster",
                 "max_model_len": info["max_model_len"]}
        return {"object": "list", "data": [model]}

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        try:
            client, body = self._client(request), await self._body(request)
            prompt = body.get("prompt")
            prompts = [prompt] if isinstance(prompt, str) else prompt
            if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
                raise BadField("prompt", "prompt must be a string or a non-empty list of strings")
            inputs = [sampling_input(body, p, chat=False) for p in prompts]
            return await self._respond(request, body, client, inputs, chat=False)
        except Exception as e:  # noqa: BLE001
            return error_response(e)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        try:
            client, body = self._client(request), await self._body(request)
            prompt = chat_prompt(self.admission.tokenizer, body)
            inputs = [sampling_input(body, prompt, chat=True)]
            return await self._respond(request, body, client, inputs, chat=True)
        except Exception as e:  # noqa: BLE001
            return error_response(e)

    # ---- shared by both generate routes ------------------------------------------------
    def _client(self, request: Request) -> str:
        """The key before anything else: a client without one learns nothing more."""
        peer = f"{request.client.host}:{request.client.port}" if request.client else ""
        return self.admission.authenticate(bearer_token(request.headers.get("authorization")), peer)

    @staticmethod
    async def _body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise AdmissionError(ErrorKind.INVALID, "request body is not JSON") from None
        if not isinstance(body, dict):
            raise AdmissionError(ErrorKind.INVALID, "request body must be a JSON object")
        return body

    async def _respond(self, request, body: dict, client: str, inputs: list[GenerateInput], chat: bool):
        n = _get(body, "n", (int,), 1)
        if not 1 <= n <= MAX_N:
            raise BadField("n", f"n must be in [1, {MAX_N}], got {n}")
        stream = _get(body, "stream", (bool,), False)
        usage_in_stream = bool(_get(body, "stream_options", (dict,), {}).get("include_usage"))
        calls = []  # choice i*n + j: prompt i, sample j
        for inp in inputs:
            call = await self.admission.admit(inp)  # checked and tokenized once for its n samples
            for j in range(n):
                # one seed would give n equal samples; seed+j keeps them reproducible and apart
                seed = None if inp.seed is None else inp.seed + j
                calls.append(call if j == 0 else replace(call, params=replace(call.params, seed=seed),
                                                         request_id=f"{call.request_id}-{j}"))
        # every sequence holds a slot: n choices cost what n requests do. All are taken
        # before any starts, so a refused request started nothing
        slots = ExitStack()
        try:
            for _ in calls:
                slots.enter_context(self.admission.slot(client))
        except BaseException:
            slots.close()
            raise
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": inputs[0].model or self.cfg.models.target}
        if stream:
            # the generator's own finally frees the slots; the background task covers a
            # response that ends before the generator ever started
            events = self._events(calls, meta, chat, n, usage_in_stream, slots)
            return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(slots.close))
        with slots:
            return await self._whole([replace(c, stream=False) for c in calls], meta, chat, n)

    async def _whole(self, calls, meta: dict, chat: bool, n: int) -> dict:
        texts, finals, counts = [""] * len(calls), [None] * len(calls), [0] * len(calls)
        lps = [[] for _ in calls]
        async with aclosing(self._merged(calls)) as outs:
            async for i, out in outs:
                texts[i] += out.text
                counts[i] += len(out.token_ids)
                lps[i] += out.logprobs or []
                if out.finished:
                    finals[i] = out
        choices, fmt = [], Formatter(self.admission.tokenizer, chat)
        for i, (text, out) in enumerate(zip(texts, finals)):
            choice = {"index": i, "finish_reason": FINISH.get(out.finish_reason, out.finish_reason),
                      "logprobs": fmt(lps[i]) if calls[i].params.logprobs is not None else None,
                      "spec": spec_of(out)}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                "usage": _usage(finals, counts, n)}

    async def _events(self, calls, meta: dict, chat: bool, n: int, with_usage: bool, slots: ExitStack):
        kind = "chat.completion.chunk" if chat else "text_completion"
        finals, counts, sent = [None] * len(calls), [0] * len(calls), [0] * len(calls)
        fmt = Formatter(self.admission.tokenizer, chat)

        def chunk(choices, usage=None) -> str:
            body = {**meta, "object": kind, "choices": choices}
            if with_usage:
                body["usage"] = usage
            return sse(body)

        try:
            if chat:  # OpenAI opens each choice with the role alone
                for i in range(len(calls)):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                                  "logprobs": None}])
            async with aclosing(self._merged(calls)) as outs:
                async for i, out in outs:
                    counts[i] += len(out.token_ids)
                    # tokens whose text is held back (part of a character) still bring their logprobs
                    lps = fmt(out.logprobs, sent[i]) if out.logprobs else None
                    sent[i] += len(out.text)
                    choice = {"index": i, "logprobs": lps, "finish_reason": None}
                    choice.update({"delta": {"content": out.text} if out.text else {}} if chat else {"text": out.text})
                    if out.finished:
                        finals[i] = out
                        choice.update(finish_reason=FINISH.get(out.finish_reason, out.finish_reason), spec=spec_of(out))
                    elif not out.text and lps is None:
                        continue
                    yield chunk([choice])
            if with_usage:
                yield chunk([], _usage(finals, counts, n))
        except Exception as e:  # noqa: BLE001 - headers are sent: the error goes as an event
            yield sse(error_body(e if isinstance(e, RequestError) else internal_error(e, "openai api")))
        finally:
            slots.close()
        yield sse("[DONE]")

    async def _merged(self, calls):
        """(choice index, output) from every call's verifier stream, as they come. Leaving
        early (the client went, or one call failed) cancels the rest, and with them their
        verifier sequences (stream_outputs cancels an unfinished call)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, call):
            try:
                async with aclosing(stream_outputs(self.verifier, call, self.cfg.router.failover_wait_s)) as outs:
                    async for out in outs:
                        await queue.put((i, out, None))
                await queue.put((i, None, None))
            except Exception as e:  # noqa: BLE001 - re-raised by the reader
                await queue.put((i, None, e))

        # each in a context of its own: Serve keeps the request's context in contextvars,
        # and n calls sharing one request's context never reached a verifier past the first
        tasks = [asyncio.create_task(pump(i, c), context=contextvars.Context()) for i, c in enumerate(calls)]
        try:
            left = len(tasks)
            while left:
                i, out, error = await queue.get()
                if error is not None:
                    raise error
                if out is None:
                    left -= 1
                else:
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _usage(finals: list, counts: list[int], n: int) -> dict:
    """Each prompt counts once however many choices it has (OpenAI's usage)."""
    firsts = [out for i, out in enumerate(finals) if out is not None and i % n == 0]
    prompt = sum(out.num_prompt for out in firsts)
    completion = sum(counts)
    cached = sum((out.stats or {}).get("cached_tokens", 0) for out in firsts)  # vLLM's and OpenAI's field
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
