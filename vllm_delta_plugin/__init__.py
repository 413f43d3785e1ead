"""delta-swap for vLLM: the ``delta_swap`` plugin keeps a running vLLM server on the newest
snapshot of a store.

* :mod:`.plugin` (``vllm.general_plugins``) registers the ``delta_swap`` weight-transfer backend
  in every vLLM process;
* :mod:`.endpoint` (``vllm.endpoint_plugins``) mounts the admin routes and starts delta-swap's
  subscriber in the API server (:mod:`delta_swap.service`);
* :mod:`.adapter` is the engine adapter: stage, drain, update, resume through vLLM's engine client;
* :mod:`.transfer_engine` is the weight-transfer backend in each worker: it points parameters into
  weight arenas, or loads staged tensors through vLLM's layerwise reload;
* :mod:`.module_groups` knows which checkpoint tensors vLLM loads into one module (fused q/k/v,
  gate/up, an MoE layer's experts), so a reload gets whole modules;
* :mod:`.verify` reads back what a worker's model computes with after a swap (``verify_swaps``);
* :mod:`.versions` tags OpenAI responses with the weight versions that produced them.
"""
