"""benchmarks/gpu_smoke.sh has never had a GPU to run on here: these tests check what can be checked
without one. It must say clearly that it measured nothing when there is no usable GPU, and the
benchmark command lines it would run must still parse with the benchmarks' own argument parsers
(the likeliest way for a script that never runs to rot)."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_smoke.sh"


def _run_with_fake_nvidia_smi(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\n" + body)
    fake.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DELTA_SWAP_CACHE": str(tmp_path / "cache"),
        "OUT": str(tmp_path / "out"),
        "PYTHON": "false",
    }  # past the checks it would fail at once, not install
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False)


def test_without_a_gpu_it_says_so_and_measures_nothing(tmp_path) -> None:
    r = _run_with_fake_nvidia_smi(tmp_path, "exit 9\n")  # what nvidia-smi does with no driver or device
    assert r.returncode == 0, r.stderr
    assert "SKIPPED: no NVIDIA GPU" in r.stdout and "nothing was measured" in r.stdout
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


def test_with_a_driver_too_old_for_the_wheels_it_says_so(tmp_path) -> None:
    r = _run_with_fake_nvidia_smi(
        tmp_path,
        'if [ "$1" = -L ]; then echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"; '
        'else echo "| Driver Version: 550.1   CUDA Version: 12.4 |"; fi\n',
    )
    assert r.returncode == 0, r.stderr
    assert "SKIPPED: the driver supports CUDA 12" in r.stdout and "nothing was measured" in r.stdout
    assert not (tmp_path / "cache").exists()


def _benchmark_commands() -> list[tuple[str, list[str]]]:
    """(module, argv) of every ``python -m benchmarks.X ...`` line of the script, continuation
    lines joined and shell variables replaced by placeholders."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        m = re.search(r"-m (benchmarks\.\w+)(.*)$", line)
        if m:
            argv = shlex.split(re.sub(r'"\$\w+/([^"]*)"', r"/tmp/out/\1", m.group(2)))
            commands.append((m.group(1), argv))
    return commands


class _Parsed(Exception):
    pass


def test_the_benchmark_command_lines_parse(monkeypatch) -> None:
    commands = _benchmark_commands()
    assert {module for module, _ in commands} == {"benchmarks.swap_window", "benchmarks.throughput_under_updates"}
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    for module, argv in commands:
        monkeypatch.setattr("sys.argv", [module, *argv])
        with pytest.raises(_Parsed) as parsed:  # an unknown flag or value exits with status 2 instead
            importlib.import_module(module).main()
        args = vars(parsed.value.args[0])
        assert args["json"].startswith("/tmp/out/") and args["plot"].startswith("/tmp/out/"), args
