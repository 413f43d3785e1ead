"""Admin HTTP routes mounted on SGLang's HTTP server: status, resync, notify."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter(prefix="/delta_swap")


def _subscriber(request: Request):
    sub = getattr(request.app.state, "delta_swap", None)
    if sub is None:
        return None, JSONResponse({"error": "delta_swap is not configured: pass --delta-swap-source URL"},
                                  status_code=503)
    return sub, None


@router.get("/status")
async def status(request: Request) -> JSONResponse:
    """Current and newest snapshot, staleness, staged snapshot, last error, last phase timings."""
    sub, error = _subscriber(request)
    if error:
        return error
    return JSONResponse({**sub.status(), "engine": "sglang", "weight_version": sub.adapter.weight_version(),
                         "drain": sub.adapter.config.drain.value})


@router.post("/resync")
async def resync(request: Request) -> JSONResponse:
    """Reload the newest full base and replay its deltas, even if the current chain looks fine."""
    sub, error = _subscriber(request)
    if error:
        return error
    ok = await sub.resync()
    return JSONResponse({"resynced": ok, **sub.status()}, status_code=200 if ok else 502)


@router.post("/notify")
async def notify(request: Request) -> JSONResponse:
    """A trainer announces a new snapshot: poll the store now instead of at the next interval."""
    sub, error = _subscriber(request)
    if error:
        return error
    sub.wake()
    return JSONResponse({"accepted": True}, status_code=202)
