"""delta-swap for vLLM: the ``delta_swap`` plugin keeps a running vLLM server on the newest
snapshot of a store.

* :mod:`.plugin` (``vllm.general_plugins``) registers the ``delta_swap`` weight-transfer backend
  in every vLLM process;
* :mod:`.transfer_engine` is that backend, running in each worker: it loads staged tensors
  through vLLM's layerwise reload;
* :mod:`.endpoint` (``vllm.endpoint_plugins``) starts the shared subscriber in the API server
  and mounts the admin routes of :mod:`.routes`;
* :mod:`.adapter` drives one swap through vLLM's engine client (pause, update, resume).
"""
