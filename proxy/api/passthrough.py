"""Every other `/v1/...` route (embeddings, completions, moderations, audio, ...), relayed to the
upstream of its `model`, else the default upstream, with both bodies streamed (SPEC §4)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable, Collection

from starlette.types import Receive, Scope, Send

from proxy.api.asgi import bearer_token
from proxy.api.auth import Caller
from proxy.api.services import Services
from proxy.deadline import Deadline
from proxy.errors import (
    ClientDisconnected,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PermissionDenied,
    ProxyError,
    ShuttingDownActed,
    UpstreamTimeout,
)
from proxy.telemetry.http import CUT_ON_PURPOSE
from proxy.upstream.client import Upstream
from proxy.upstream.form_model import AmbiguousModel
from proxy.upstream.relay import FORM_MODEL_WITHIN, relay, sniff_model

log = logging.getLogger(__name__)

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]
SAFE_METHODS = frozenset({"GET", "HEAD"})
# A client's headers that pick the account billed, or carry a key of its own: not sent beside
# the proxy's key (a key of several organisations or projects would bill the client's choice).
ACCOUNT_HEADERS = frozenset({b"openai-organization", b"openai-project", b"x-api-key", b"api-key"})
# The relayed routes that run the model their body names: a key limited to some models may use
# these alone (a POST). Others act on the account the upstream key belongs to (files, batches,
# fine-tunes, stored completions, costs): they are for keys that may use every model.
MODEL_ROUTES = frozenset(
    {
        "/v1/embeddings",
        "/v1/completions",
        "/v1/moderations",
        "/v1/audio/speech",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/images/generations",
        "/v1/images/edits",
        "/v1/images/variations",
        "/v1/responses/input_tokens",
        "/v1/rerank",
        "/v1/score",
    }
)


async def client_body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected("client went away while sending its body")
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body"):
            return


# Below these templates OpenAI has routes of its own too (`/v1/responses/input_tokens`): only a
# path whose id begins as the proxy's ids do is the proxy's.
SHARED_TEMPLATES = {"/v1/responses/": "resp_"}


class Passthrough:
    """A raw ASGI app; `own_paths` are the proxy's routes, for which another method is a 405
    rather than a relay. Below a route's template (`/v1/runs/{run_id}`) a path is the proxy's:
    the ids in it are its own, which no upstream knows (SHARED_TEMPLATES: those that look so).
    """

    def __init__(self, services: Callable[[], Services], own_paths: Collection[str]) -> None:
        self.services = services
        self.own_paths = frozenset(p for p in own_paths if "{" not in p)
        self.own_prefixes = tuple(p[: p.index("{")] for p in own_paths if "{" in p)
        self.own_templates = tuple(_template(p) for p in own_paths if "{" in p)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if path in self.own_paths:
            raise MethodNotAllowed(f"{scope['method']} is not allowed on {path}")
        for prefix in self.own_prefixes:
            rest = path[len(prefix) :]
            if path.startswith(prefix) and rest.startswith(SHARED_TEMPLATES.get(prefix, "")):
                if "/" in rest and not any(t.fullmatch(path) for t in self.own_templates):
                    raise NotFound(f"the proxy has no route {path[:300]}")
                raise MethodNotAllowed(f"{scope['method']} is not allowed on {path[:300]}")
        sv = self.services()
        bearer = bearer_token(scope)
        caller = sv.keys.caller(bearer)
        restricted = caller is not None and not caller.unrestricted
        if caller is not None and restricted and not _runs_a_model(scope["method"], path):
            raise PermissionDenied(
                f"key {caller.name!r} may use only the models it names: {scope['method']} "
                f"{path[:300]} does not run a model (its routes: POST "
                f"{', '.join(sorted(MODEL_ROUTES))})",
                code="route_not_allowed",
            )
        bounds = sv.config.server
        model, body = await sniff_model(
            scope["headers"],
            client_body(receive),
            limit=bounds.max_body_bytes,
            exact=restricted,
            max_values=bounds.max_body_values,
        )
        upstream = sv.config.default_upstream
        if model is None and caller is not None and restricted:
            raise self._unread(caller)
        if model is not None:
            sv.keys.check(caller, model)
            agent = sv.config.agents.get(model)
            upstream = sv.planner.target(agent.model if agent else model).upstream
        raw_path = scope.get("raw_path") or scope["path"].encode()
        try:
            target = sv.upstream(upstream, bearer)
            headers = scope["headers"]
            if target.api_key and not sv.forwards_client_key(upstream):  # the proxy's key
                headers = [(k, v) for k, v in headers if k not in ACCOUNT_HEADERS]
            path = raw_path.decode("latin-1")
            await self._relay(target, scope, path, headers, body, send)
        except asyncio.CancelledError:
            safe = scope["method"] in SAFE_METHODS  # (the upstream acted on nothing)
            if safe or not sv.shutdown.stopped(asyncio.current_task()):
                raise
            raise ShuttingDownActed(
                "the server shut down before the upstream's answer was relayed (the upstream "
                "may have acted on the request)"
            ) from None
        except AmbiguousModel:  # a second `model` in a form, found as it was sent
            raise self._unread(caller) from None
        except ValueError as exc:  # a path the relay refuses to send on
            raise InvalidRequest(str(exc)) from None

    def _unread(self, caller: Caller | None) -> PermissionDenied:
        bounds = self.services().config.server
        name = caller.name if caller is not None else ""
        return PermissionDenied(
            f"key {name!r} may use only the models it names, and the model of this request "
            f"cannot be read (a JSON body of at most {bounds.max_body_bytes} bytes "
            f"(server.max_body_bytes) and {bounds.max_body_values} values "
            "(server.max_body_values) naming one `model`, a string, or a form with one `model` "
            f"field in its first {FORM_MODEL_WITHIN} bytes)",
            param="model",
        )

    @staticmethod
    async def _relay(
        upstream: Upstream,
        scope: Scope,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: AsyncIterator[bytes],
        send: Send,
    ) -> None:
        """Within the upstream's `step_timeout_s` in all, as a run's step is: a 504 before the
        answer started, else the answer left unfinished (its connection closed). The time the
        client takes to read is not counted, but a client that takes nothing for as long has
        gone: its connection is let go (an upstream connection is never held for one that
        does not read)."""
        limit = upstream.step_timeout_s
        timer = Deadline(asyncio.get_running_loop().time() + limit, limit)
        started = False
        try:
            async with relay(
                upstream,
                scope["method"],
                path,
                query=scope.get("query_string", b"").decode("latin-1"),
                headers=headers,
                body=body,
            ) as answer:
                timer.hold()
                start = {"type": "http.response.start", "status": answer.status}
                await send({**start, "headers": answer.headers})
                timer.release()
                started = True
                async for chunk in answer.body:
                    timer.hold()
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    timer.release()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not timer.disarm():
                raise
            if timer.held_out:
                raise ClientDisconnected(f"the client took nothing for {limit:g} s") from None
            if not started:
                raise UpstreamTimeout(
                    f"upstream {upstream.name} did not finish within {limit:g} s"
                ) from None
            # Begun: the answer is left unfinished, and the server closes the connection.
            log.warning("upstream %s did not finish within %g s: cut", upstream.name, limit)
            CUT_ON_PURPOSE.set(True)
        except ProxyError as exc:
            if not started:
                raise
            log.warning("upstream %s: the relayed answer was cut: %s", upstream.name, exc)
            CUT_ON_PURPOSE.set(True)
        finally:
            timer.disarm()


def _runs_a_model(method: str, path: str) -> bool:
    return method == "POST" and path.rstrip("/") in MODEL_ROUTES


def _template(path: str) -> re.Pattern[str]:
    """A route's path with each `{param}` as one segment."""
    return re.compile("[^/]+".join(re.escape(part) for part in re.split(r"\{[^}]*\}", path)))
