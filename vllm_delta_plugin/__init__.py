"""delta-swap for vLLM: the ``delta_swap`` plugin keeps a running vLLM server on the newest
snapshot of a store.

* :mod:`.plugin` (``vllm.general_plugins``) registers the ``delta_swap`` weight-transfer backend
  in every vLLM process;
* :mod:`.endpoint` (``vllm.endpoint_plugins``) mounts the admin routes and starts delta-swap's
  subscriber in the API server (:mod:`delta_swap.service`); where ``vllm serve`` starts several
  API servers (``--api-server-count``, by default one per data-parallel engine), API server 0
  runs it and the others follow it (:mod:`delta_swap.front_ends`);
* :mod:`.adapter` is the engine adapter: stage, drain, update, resume through vLLM's engine client;
* :mod:`.transfer_engine` is the weight-transfer backend in each worker: it points parameters into
  weight arenas, or loads staged tensors through vLLM's layerwise reload;
* :mod:`.worker_results` carries every worker's answer (describe, read-back) to the API server;
  a reload gets whole modules (:mod:`delta_swap.module_groups`) and is read back before the
  engine generates (:mod:`delta_swap.readback`, ``verify_swaps``; at TP > 1 each rank against its
  own shard, built by :mod:`.readback_shards` through the layers' own weight loaders);
* :mod:`.versions` tags OpenAI responses with the weight versions that produced them;
* :mod:`.trainer_engine` is the trainer side of vLLM's weight-transfer API: the ``delta_swap``
  trainer engine (``WeightTransferTrainerFactory``) publishes each ``send_weights()`` to the store;
* :mod:`.trl_sync` makes TRL's server-mode weight sync (``GRPOTrainer``) publish through that
  engine instead of NCCL (a ``DeltaSwapSync`` callback);
"""
