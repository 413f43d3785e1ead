"""Start real engine servers as child processes, with or without the ``delta_swap`` plugin: one
recipe per engine (:mod:`.vllm`, :mod:`.sglang`) on a generic process runner (:mod:`.process`).
The demo, the RL example, the benchmarks and the engine tests all start their servers here, with
the settings this CPU-only machine needs (see ../shared/engines-on-cpu.md and docs/SGLANG.md)."""
