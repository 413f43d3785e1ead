"""delta-swap for SGLang: the ``delta_swap`` plugin keeps a running SGLang server on the newest
snapshot of a store.

* :mod:`.plugin` (``sglang.srt.plugins``) hooks SGLang through its ``HookRegistry``: the
  ``--delta-swap-*`` flags on the server's parser and, in the HTTP server process, the routes
  and the subscriber; in the scheduler process, the description of its parameters and the paused
  loop's hook;
* :mod:`.server` mounts the admin routes and runs delta-swap's subscriber for as long as the
  server's app lives (:mod:`delta_swap.service`);
* :mod:`.adapter` is the engine adapter: stage, drain, update, resume through the tokenizer manager;
* :mod:`.engine_ops` is delta-swap's code in the scheduler process, where the parameters live: it
  lays them out as weight arenas and commits reference swaps, and stages and applies shadow and
  in-place updates (:mod:`delta_swap.staged_swap`);
* :mod:`.scheduler_channel` reaches each scheduler from the HTTP server process (staging while
  SGLang generates, the swap in the pause);
* :mod:`.paused_loop` runs the swap on the scheduler's own thread, between iterations of its
  paused loop;
* :mod:`.staging` packs tensors into one shared-memory bucket for ``update_weights_from_tensor``;
* :mod:`.versions` tags OpenAI responses with the weight versions that produced them.
"""
