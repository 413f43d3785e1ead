"""Admin HTTP routes mounted on SGLang's HTTP server: status, resync, notify."""

from delta_swap.admin_routes import make_router

router = make_router("pass --delta-swap-source URL")
