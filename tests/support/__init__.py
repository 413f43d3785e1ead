"""Helpers shared by the test modules: synthetic weight chains, a fault-injecting proxy, the
engine-agnostic rollout scenarios, and the scripted SGLang adapter probe."""
