"""Weight versions on the OpenAI-compatible routes: every completion says which snapshot made it.

:class:`WeightVersionMiddleware` (ASGI, engine-agnostic) wraps ``/v1/completions`` and
``/v1/chat/completions``:

* a non-streaming response gets ``weight_versions`` on every choice (spans
  ``[{"version", "start", "end"}]`` over the choice's generated tokens) and the headers
  ``X-Weight-Version`` (the snapshot that produced the last token) and ``X-Weight-Versions``
  (the spans of every choice, JSON);
* a streaming response gets ``X-Weight-Version`` with the snapshot served when the request was
  admitted (headers leave before the first token), and the chunk that finishes each choice gets
  that choice's ``weight_versions``.

Spans come from the engine (vLLM's and SGLang's outputs track them per token range) through
:func:`record`, which an engine adapter calls from inside the request's handling (a context
variable finds the request). Where the engine reported nothing, the snapshot served at admission
stands in: exact whenever the drain mode keeps each request on one version (``wait``, ``abort``).
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Callable
from typing import Any

ROUTES = ("/v1/completions", "/v1/chat/completions")
_recorder: contextvars.ContextVar[SpanRecorder | None] = contextvars.ContextVar("delta_swap_spans", default=None)


class SpanRecorder:
    """The weight-version spans of one HTTP request's choices, filled while it runs."""

    def __init__(self, admitted: str | None) -> None:
        self.admitted = admitted
        self.by_index: dict[int, list[dict[str, Any]]] = {}
        self.calls = 0

    def next_call(self) -> int:
        """Number the engine calls of this request (one per prompt), in the order they start."""
        self.calls += 1
        return self.calls - 1

    def spans(self, index: int, tokens: int | None) -> list[dict[str, Any]]:
        recorded = self.by_index.get(index)
        if recorded:
            return recorded
        return [{"version": self.admitted, "start": 0, "end": tokens}] if self.admitted else []


def current_recorder() -> SpanRecorder | None:
    """The recorder of the request being handled (None outside the wrapped routes)."""
    return _recorder.get()


def record(index: int, spans: list[Any]) -> None:
    """Store the spans (objects or dicts with version, start, end) of choice ``index`` of the
    request being handled; a no-op outside the wrapped routes."""
    recorder = _recorder.get()
    if recorder is not None and spans:
        recorder.by_index[index] = [_span(s) for s in spans]


def _span(span: Any) -> dict[str, Any]:
    if isinstance(span, dict):
        return {"version": span.get("version"), "start": span.get("start"), "end": span.get("end")}
    return {
        "version": getattr(span, "version", None),
        "start": getattr(span, "start", None),
        "end": getattr(span, "end", None),
    }


class WeightVersionMiddleware:
    """Adds weight versions to the OpenAI-compatible completion routes (see the module doc)."""

    def __init__(self, app: Any, current_version: Callable[[], str | None], routes: tuple[str, ...] = ROUTES) -> None:
        self.app = app
        self.current_version = current_version
        self.routes = routes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope.get("type") != "http" or scope.get("path") not in self.routes:
            await self.app(scope, receive, send)
            return
        recorder = SpanRecorder(self.current_version())
        token = _recorder.set(recorder)
        try:
            await self.app(scope, receive, _Rewriter(send, recorder).send)
        finally:
            _recorder.reset(token)


class _Rewriter:
    """Rewrites one response as it is sent: JSON bodies whole, event streams event by event."""

    def __init__(self, send: Callable, recorder: SpanRecorder) -> None:
        self._send = send
        self.recorder = recorder
        self.start: dict | None = None
        self.mode = "pass"
        self.body = bytearray()

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            headers = dict((k.lower(), v) for k, v in message.get("headers", []))
            content_type = headers.get(b"content-type", b"")
            if message.get("status") == 200 and content_type.startswith(b"application/json"):
                self.mode, self.start = "json", message  # held until the body is complete
                return
            if message.get("status") == 200 and content_type.startswith(b"text/event-stream"):
                self.mode = "sse"
                if self.recorder.admitted is not None:
                    message = {
                        **message,
                        "headers": [
                            *message.get("headers", []),
                            (b"x-weight-version", self.recorder.admitted.encode()),
                        ],
                    }
            await self._send(message)
            return
        if message["type"] != "http.response.body" or self.mode == "pass":
            await self._send(message)
            return
        self.body += message.get("body", b"")
        more = message.get("more_body", False)
        if self.mode == "json":
            if not more:
                await self._send_json()
            return
        *events, rest = bytes(self.body).split(b"\n\n")
        self.body = bytearray(rest)
        out = b"".join(self._event(e) + b"\n\n" for e in events)
        if not more and rest:
            out += self._event(rest)
            self.body.clear()
        await self._send({"type": "http.response.body", "body": out, "more_body": more})

    async def _send_json(self) -> None:
        assert self.start is not None
        body = bytes(self.body)
        extra: list[tuple[bytes, bytes]] = []
        try:
            doc = json.loads(body)
            all_spans = [self._tag(choice) for choice in doc.get("choices", [])]
            last = next((spans[-1]["version"] for spans in reversed(all_spans) if spans), self.recorder.admitted)
            body = json.dumps(doc).encode()
            extra = [(b"x-weight-versions", json.dumps(all_spans).encode())]
            if last is not None:
                extra.append((b"x-weight-version", str(last).encode()))
        except (ValueError, AttributeError, TypeError):
            pass  # not a completion document: leave it as it is
        headers = [(k, v) for k, v in self.start.get("headers", []) if k.lower() != b"content-length"]
        headers += [(b"content-length", str(len(body)).encode()), *extra]
        await self._send({**self.start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data:") or event.strip() == b"data: [DONE]":
            return event
        try:
            doc = json.loads(event[5:])
            tagged = False
            for choice in doc.get("choices", []):
                if choice.get("finish_reason") is not None:
                    self._tag(choice)
                    tagged = True
            return b"data: " + json.dumps(doc).encode() if tagged else event
        except (ValueError, AttributeError, TypeError):
            return event

    def _tag(self, choice: dict) -> list[dict[str, Any]]:
        spans = self.recorder.spans(int(choice.get("index", 0)), None)
        choice["weight_versions"] = spans
        return spans
