"""The admin HTTP routes every engine adapter mounts: ``/delta_swap/status``, ``/resync``,
``/notify``. Engine-agnostic (FastAPI, which vLLM and SGLang both serve with); the subscriber
is read from ``app.state.delta_swap`` and engine details come from ``EngineAdapter.describe``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse


def make_router(not_configured: str) -> APIRouter:
    """The routes; ``not_configured`` tells operators how to enable following a store."""
    router = APIRouter(prefix="/delta_swap")

    def subscriber(request: Request) -> Any:
        return getattr(request.app.state, "delta_swap", None)

    def unavailable() -> JSONResponse:
        return JSONResponse({"error": f"delta_swap is not configured: {not_configured}"}, status_code=503)

    @router.get("/status")
    async def status(request: Request) -> JSONResponse:
        """Current and newest snapshot, staleness, staged snapshot, last error, last phase timings."""
        sub = subscriber(request)
        if sub is None:
            return unavailable()
        return JSONResponse({**sub.status(), **await sub.adapter.describe()})

    @router.post("/resync")
    async def resync(request: Request) -> JSONResponse:
        """Reload the newest full base and replay its deltas, even if the current chain looks fine."""
        sub = subscriber(request)
        if sub is None:
            return unavailable()
        ok = await sub.resync()
        return JSONResponse({"resynced": ok, **sub.status()}, status_code=200 if ok else 502)

    @router.post("/notify")
    async def notify(request: Request) -> JSONResponse:
        """A trainer announces a new snapshot: poll the store now instead of at the next interval."""
        sub = subscriber(request)
        if sub is None:
            return unavailable()
        sub.wake()
        return JSONResponse({"accepted": True}, status_code=202)

    return router
