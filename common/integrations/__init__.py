"""Hooks for the trainers people already use (imported on demand; the core does not need torch).

* :mod:`.sharded`: publish from every rank of a sharded trainer (FSDP2 / DTensor parameters) without
  gathering the whole model on one rank;
* :mod:`.hf_trainer`: a ``transformers.TrainerCallback`` that publishes after each optimizer step,
  for ``transformers.Trainer`` and TRL's trainers built on it;
* :mod:`.verl`: the ``delta_swap`` backend of verl's checkpoint-engine registry;
* :mod:`.servers`: the step each server serves, and waiting for one (a trainer's staleness bound);
* :mod:`.versions`: the vLLM, TRL and verl versions the integrations support, pinned in one place.
"""
