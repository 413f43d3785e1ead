"""Running delta-swap inside an engine's HTTP server: what an engine plugin calls, and nothing else.

An engine plugin does three things, at the points its engine offers:

* :func:`mount` before the server's app starts: the admin routes, and the middleware that puts
  weight versions on the OpenAI-compatible completion routes (the plugin also feeds it the
  engine's spans, :func:`delta_swap.version_tags.record`);
* :func:`start` once the engine is up, with the settings and the engine adapter: it builds the
  subscriber, attaches it to the app state and starts following the store on the running loop
  (where several HTTP front ends serve one deployment, the first one does, and the others follow
  it: :mod:`.front_ends`);
* :func:`stop` when the server shuts down.
"""

from __future__ import annotations

import logging
from typing import Any

from .admin_routes import admin_access_line, mount_admin_routes, served_version, set_subscriber, subscriber_of
from .engine_adapter import EngineAdapter
from .front_ends import Follower, FrontEnd, Leader
from .settings import Settings
from .stores.base import public_url
from .version_tags import WeightVersionMiddleware

log = logging.getLogger("delta_swap.service")

__all__ = ["mount", "served_version", "start", "stop"]


def mount(app: Any, not_configured: str) -> None:
    """Add the admin routes and the weight-version middleware to ``app`` (once, before it starts);
    ``not_configured`` tells operators how to enable following a store."""
    if any(getattr(r, "path", "").startswith("/delta_swap/") for r in app.routes):
        return
    mount_admin_routes(app, not_configured)
    app.add_middleware(WeightVersionMiddleware, current_version=lambda: served_version(app.state))


def start(app_state: Any, settings: Settings, adapter: EngineAdapter | None, front_end: FrontEnd | None = None) -> Any:
    """Follow ``settings.store`` with ``adapter`` (call on the server's event loop); returns the
    subscriber, or None (and the routes answer 503) when no store is configured. ``front_end``
    places this HTTP server among several of one deployment: the first follows the store (and
    answers the others), the others need no adapter and return their :class:`.Follower`."""
    # Imported here: the subscriber's Prometheus metrics must register after the engine has set
    # up its metrics (SGLang's multiprocess mode), so that they appear on the engine's /metrics.
    from .subscriber import Subscriber

    if settings.store and front_end is not None and not front_end.leads:
        show_info_logs()
        follower = Follower(settings, front_end)
        set_subscriber(app_state, follower)
        follower.start()
        log.info("delta-swap: API server %d of %d follows API server 0", front_end.index, front_end.count)
        return follower
    if not settings.store or adapter is None:
        set_subscriber(app_state, None)
        log.warning(
            "delta-swap: no store configured (%s); the server will not follow a store", Settings.env_name("store")
        )
        return None
    show_info_logs()
    subscriber = Subscriber(settings, adapter)
    if front_end is not None and front_end.count > 1:
        leader = Leader(subscriber, front_end)
        set_subscriber(app_state, leader)
        leader.start()
    else:
        set_subscriber(app_state, subscriber)
        subscriber.start()
    log.info(
        "delta-swap: %s follows %s (drain=%s, %d tensors served)",
        adapter.name,
        public_url(settings.store),
        settings.drain.value,
        len(adapter.served.specs),
    )
    (log.info if settings.admin_token and not settings.admin_open_loopback else log.warning)(
        admin_access_line(settings.admin_token, settings.admin_open_loopback)
    )
    return subscriber


def show_info_logs() -> None:
    """Make delta-swap's INFO lines (one per applied update, with its phase timings) reach the
    server's output. SGLang configures the root logger; vLLM configures only its own, and Python
    then prints WARNING and above only. A level set on the ``delta_swap`` logger is left alone."""
    pkg = logging.getLogger("delta_swap")
    if pkg.level != logging.NOTSET:
        return
    pkg.setLevel(logging.INFO)
    if not pkg.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        pkg.addHandler(handler)


async def stop(app: Any) -> None:
    """Stop the subscriber attached to ``app`` (if any) and detach it."""
    subscriber = subscriber_of(app)
    set_subscriber(app.state, None)
    if subscriber is not None:
        await subscriber.stop()
