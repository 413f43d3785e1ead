"""delta-swap test suite (engine-free core tests, transports, and real vLLM / SGLang servers)."""
