"""The admin HTTP routes of a rollout server: ``GET /delta_swap/status``, ``POST /delta_swap/resync``
and ``POST /delta_swap/notify``. Engine-agnostic (FastAPI, which vLLM and SGLang both serve with).

``status`` is open to anyone and shows no secret. The POST routes move weights or make the server
poll, so they need ``Authorization: Bearer <admin_token>`` (compared in constant time). A server
without a token refuses them to everyone, unless its operator set ``admin_open_loopback``: then
loopback clients may use them (every process on the host, and every client of a reverse proxy on
it). One resync runs at a time (another gets 409), and a resync never moves the server to an
older step unless the request says ``?allow_older=1``. Notifies are coalesced by the subscriber
(at most one poll per ``notify_interval``).

The routes act on the app's :class:`RouteTarget`: the server's subscriber, or where several HTTP
front ends serve one deployment, the front end that leads or follows it (:mod:`.front_ends`). It
lives on the app's state under one attribute, read and written only through :func:`subscriber_of`
and :func:`set_subscriber`.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

if TYPE_CHECKING:
    from .settings import Settings

log = logging.getLogger("delta_swap.admin")

#: The attribute of ``app.state`` that holds the server's subscriber (None when idle).
STATE_ATTR = "delta_swap"


class RouteTarget(Protocol):
    """What the routes need of a subscriber (:class:`~delta_swap.subscriber.Subscriber` is one)."""

    settings: Settings

    @property
    def resync_running(self) -> bool: ...

    @property
    def served_snapshot_id(self) -> str | None: ...

    def status(self) -> dict[str, Any]: ...

    async def describe(self) -> dict[str, Any]: ...

    async def resync(self, *, allow_older: bool = False) -> bool: ...

    def wake(self) -> None: ...

    async def stop(self) -> None: ...


def set_subscriber(state: Any, subscriber: RouteTarget | None) -> None:
    """Attach ``subscriber`` to an app's state (``app.state``)."""
    setattr(state, STATE_ATTR, subscriber)


def subscriber_of(app: Any) -> RouteTarget | None:
    """The subscriber attached to ``app``, or None."""
    return getattr(app.state, STATE_ATTR, None)


def served_version(state: Any) -> str | None:
    """The snapshot the server behind an app's state serves now (None before the first sync)."""
    subscriber: RouteTarget | None = getattr(state, STATE_ATTR, None)
    return subscriber.served_snapshot_id if subscriber is not None else None


def mount_admin_routes(app: FastAPI, not_configured: str) -> None:
    """Add the routes to ``app`` once; ``not_configured`` tells operators how to enable the plugin."""
    if not any(getattr(r, "path", "").startswith("/delta_swap/") for r in app.routes):
        app.include_router(_router(not_configured))


def _router(not_configured: str) -> APIRouter:
    router = APIRouter(prefix="/delta_swap")

    def unavailable() -> JSONResponse:
        return JSONResponse({"error": f"delta_swap is not configured: {not_configured}"}, status_code=503)

    @router.get("/status")
    async def status(request: Request) -> JSONResponse:
        """Current and newest snapshot, staleness, last error, last phase timings, engine details."""
        sub = subscriber_of(request.app)
        if sub is None:
            return unavailable()
        return JSONResponse(await sub.describe())

    def admin(request: Request) -> tuple[RouteTarget | None, JSONResponse | None]:
        """The subscriber, if the caller may use a POST route; else the response that refuses it."""
        sub = subscriber_of(request.app)
        if sub is None:
            return None, unavailable()
        return sub, _refusal(request, sub.settings.admin_token, sub.settings.admin_open_loopback)

    @router.post("/resync")
    async def resync(request: Request, allow_older: bool = False) -> JSONResponse:
        """Reload the newest full base and replay its deltas, even if the current chain looks fine."""
        sub, refused = admin(request)
        if sub is None or refused is not None:
            return refused or unavailable()
        if sub.resync_running:
            return JSONResponse({"error": "a resync is already running"}, status_code=409)
        ok = await sub.resync(allow_older=allow_older)
        return JSONResponse({"resynced": ok, **sub.status()}, status_code=200 if ok else 502)

    @router.post("/notify")
    async def notify(request: Request) -> JSONResponse:
        """A trainer announces a new snapshot: poll the store now instead of at the next interval."""
        sub, refused = admin(request)
        if sub is None or refused is not None:
            return refused or unavailable()
        sub.wake()
        return JSONResponse({"accepted": True}, status_code=202)

    return router


def admin_access_line(token: str | None, open_loopback: bool) -> str:
    """The one line a server logs at start about who may use its POST routes."""
    if token:
        return "delta-swap: POST /delta_swap/resync and /notify need the admin token" + (
            " (admin_open_loopback is ignored: the token is required from every caller)" if open_loopback else ""
        )
    if open_loopback:
        return (
            "delta-swap: POST /delta_swap/resync and /notify are open to every loopback caller, including the "
            "clients of any reverse proxy on this host (admin_open_loopback); set DELTA_SWAP_ADMIN_TOKEN instead"
        )
    return (
        "delta-swap: POST /delta_swap/resync and /notify are refused to every caller: no admin token "
        "(set DELTA_SWAP_ADMIN_TOKEN, or DELTA_SWAP_ADMIN_OPEN_LOOPBACK=1 to let loopback callers in)"
    )


def _refusal(request: Request, token: str | None, open_loopback: bool = False) -> JSONResponse | None:
    """None if the caller may use a POST route, else the response that refuses it."""
    if token:
        given = request.headers.get("authorization", "")
        scheme, _, credential = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(credential.strip().encode(), token.encode()):
            return None
        log.warning(
            "delta-swap: refused %s %s from %s: bad or missing admin token",
            request.method,
            request.url.path,
            request.client and request.client.host,
        )
        return JSONResponse(
            {"error": "this route needs Authorization: Bearer <admin token>"},
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    if open_loopback and _is_loopback(request.client.host if request.client else None):
        return None
    if open_loopback:
        return JSONResponse(
            {"error": "without an admin token (DELTA_SWAP_ADMIN_TOKEN) this route answers loopback clients only"},
            status_code=403,
        )
    return JSONResponse(
        {"error": "this server has no admin token (DELTA_SWAP_ADMIN_TOKEN): its POST routes are closed"},
        status_code=403,
    )


def _is_loopback(host: str | None) -> bool:
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return host == "localhost"
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))
