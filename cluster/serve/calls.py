"""What crosses the ingress -> verifier boundary, in no protocol's terms.

An ingress (the gRPC Router; an HTTP one can follow) turns its request into a
`GenerateCall`, streams the verifier's outputs with `stream_outputs`, and maps the
`ErrorKind` of any failure onto its own status codes, in one table of its own. Nothing here
imports grpc, Ray or torch: the verifier, the request router (which Serve pickles by value
into every process holding a Verifier handle) and unit tests import it cheaply.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import traceback
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.engine.sampling import SamplingParams
    from cluster.engine.scheduling.sequence import SpecParams

log = logging.getLogger(__name__)

MIN_TRIES = 3  # failed calls in a row before giving up, when failover_wait_s > 0


class ErrorKind(enum.Enum):
    """Why a request failed; each ingress maps these onto its protocol's codes."""
    INVALID = "invalid"                  # bad input: the message names the field
    UNAUTHENTICATED = "unauthenticated"  # no API key, or a wrong one
    NOT_FOUND = "not_found"              # a model this cluster does not serve
    EXHAUSTED = "exhausted"              # a limit: router in flight, per client, the verifier's queue
    UNAVAILABLE = "unavailable"          # no verifier answered; a retry may succeed
    DEADLINE = "deadline"
    CANCELLED = "cancelled"
    INTERNAL = "internal"                # a bug: the message names the exception type only


@dataclass
class GenerateCall:
    """What an ingress sends a Verifier for one request: already validated and tokenized."""
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecParams
    drafter: str | None = None
    request_id: str | None = None
    stream: bool = True  # False: the caller wants the whole answer (the verifier sends it in few messages)


@dataclass
class ErrorOutput:
    """A request's failure as an item of the verifier's stream rather than an exception,
    so its kind and message survive the hop unchanged."""
    kind: ErrorKind
    message: str


class RequestError(Exception):
    """A request refused or failed, with the kind an ingress maps to its status code."""

    def __init__(self, kind: ErrorKind, message: str):
        super().__init__(message)
        self.kind, self.message = kind, message


def internal_error(e: BaseException, where: str) -> RequestError:
    """An unexpected exception as an INTERNAL error. The log gets its type and line but
    not its message, and neither does the client: it may quote the prompt."""
    tb = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    log.error("internal error in the %s: %s at %s:%s", where, type(e).__name__,
              tb.filename if tb else "?", tb.lineno if tb else "?")
    return RequestError(ErrorKind.INTERNAL, f"internal error ({type(e).__name__})")


async def stream_outputs(verifier, call: GenerateCall, failover_wait_s: float = 0.0):
    """The verifier's outputs for `call`, from a Serve handle to the Verifier deployment.

    An `ErrorOutput` is raised as a RequestError of its kind. A broken call (the replica
    died, the hop failed) is resubmitted, to whichever replica Serve routes it to, as the
    prompt plus every token already streamed with that many fewer to go: the stream goes on
    with no gap and no repeat, a greedy one with the tokens an unbroken run gives, a sampled
    one with a sample of the same distribution. Retries back off for up to `failover_wait_s`
    from the failure (Serve needs a moment to route around a dead replica or replace it);
    then UNAVAILABLE, since the client may retry. If the stream stops before the last output
    (the client left, or the call failed) the verifier call is cancelled, so the verifier
    frees the sequence now. Across a resubmission the final output's `stats` are those of
    the last call's part.
    """
    emitted: list[int] = []
    give_up, backoff, tries = None, 0.1, 0
    while True:
        part = call if not emitted else continuation(call, emitted)
        gen = verifier.options(stream=True).generate.remote(part)
        done = False
        try:
            async for out in gen:
                if isinstance(out, ErrorOutput):
                    raise RequestError(out.kind, out.message)
                done = out.finished
                emitted += out.token_ids
                out.num_prompt = len(call.prompt_ids)
                give_up, backoff, tries = None, 0.1, 0  # progress: a later failure gets a wait of its own
                yield out
            if done:
                return
            raise RuntimeError("the verifier's stream ended before its last output")
        except RequestError:
            raise
        except Exception as e:  # noqa: BLE001
            now = time.monotonic()
            give_up, tries = give_up or now + failover_wait_s, tries + 1
            left = call.params.max_tokens - len(emitted)
            # a retry that itself hung past the window still gets a successor: with a wait
            # configured, it takes MIN_TRIES failed calls in a row to give up
            retry = left > 0 and (now < give_up or 0 < failover_wait_s and tries < MIN_TRIES)
            log.warning("verifier call failed after %d tokens (%s: %s)%s", len(emitted), type(e).__name__, e,
                        "; resubmitting" if retry else "")
            if not retry:
                raise RequestError(ErrorKind.UNAVAILABLE, f"verifier unavailable: {type(e).__name__}") from None
            await asyncio.sleep(max(0.0, min(backoff, give_up - now)))
            backoff = min(2 * backoff, 1.0)
        finally:
            if not done:
                gen.cancel()


def continuation(call: GenerateCall, emitted: list[int]) -> GenerateCall:
    """`call` resumed after `emitted` tokens: they join the prompt and leave max_tokens. A
    seeded request moves to a stream of its own: restarted at its seed it would reuse the
    draws of its first tokens, tying the tokens after the seam to those before it."""
    params = replace(call.params, max_tokens=call.params.max_tokens - len(emitted))
    if params.seed is not None:
        params = replace(params, seed=(params.seed + 1_000_003 * len(emitted)) % 2**63)
    return replace(call, prompt_ids=call.prompt_ids + emitted, params=params)
