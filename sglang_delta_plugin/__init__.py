"""delta-swap for SGLang: the ``delta_swap`` plugin keeps a running SGLang server on the newest
snapshot of a store.

* :mod:`.plugin` (``sglang.srt.plugins``) hooks SGLang through its ``HookRegistry``: the
  ``--delta-swap-*`` flags on the server's parser and, in the HTTP server process, the routes
  and the subscriber; the scheduler and detokenizer processes are left untouched;
* :mod:`.config` holds the flags and their ``DELTA_SWAP_*`` environment fallbacks;
* :mod:`.server` mounts :mod:`.routes` and runs the shared subscriber on the server's loop;
* :mod:`.staging` validates tensors against the served checkpoint and packs them in shared memory;
* :mod:`.adapter` drives one swap through the tokenizer manager (drain, update, resume).
"""
