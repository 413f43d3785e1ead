"""Admin HTTP routes mounted on vLLM's OpenAI server: status, resync, notify."""

from delta_swap.admin_routes import make_router

router = make_router("set DELTA_SWAP_STORE (and VLLM_PLUGINS=delta_swap)")
