"""The admin HTTP routes of a rollout server: ``GET /delta_swap/status``, ``POST /delta_swap/resync``
and ``POST /delta_swap/notify``. Engine-agnostic (FastAPI, which vLLM and SGLang both serve with).

The server's subscriber lives on the app's state under one attribute, read and written only
through :func:`subscriber_of` and :func:`set_subscriber`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

if TYPE_CHECKING:
    from .subscriber import Subscriber

#: The attribute of ``app.state`` that holds the server's subscriber (None when idle).
STATE_ATTR = "delta_swap"


def set_subscriber(state: Any, subscriber: Subscriber | None) -> None:
    """Attach ``subscriber`` to an app's state (``app.state``)."""
    setattr(state, STATE_ATTR, subscriber)


def subscriber_of(app: Any) -> Subscriber | None:
    """The subscriber attached to ``app``, or None."""
    return getattr(app.state, STATE_ATTR, None)


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

    @router.post("/resync")
    async def resync(request: Request) -> JSONResponse:
        """Reload the newest full base and replay its deltas, even if the current chain looks fine."""
        sub = subscriber_of(request.app)
        if sub is None:
            return unavailable()
        ok = await sub.resync()
        return JSONResponse({"resynced": ok, **sub.status()}, status_code=200 if ok else 502)

    @router.post("/notify")
    async def notify(request: Request) -> JSONResponse:
        """A trainer announces a new snapshot: poll the store now instead of at the next interval."""
        sub = subscriber_of(request.app)
        if sub is None:
            return unavailable()
        sub.wake()
        return JSONResponse({"accepted": True}, status_code=202)

    return router
