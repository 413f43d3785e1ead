"""Engine servers import the plugin from the checkout that starts them (examples/servers/process.py),
not from whatever checkout last pointed the shared cached environment at itself."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from examples.servers.process import ROOT, launch_server


def test_a_server_imports_this_checkout_before_anything_else_on_its_path(tmp_path: Path, monkeypatch) -> None:
    other = tmp_path / "other-checkout"
    for name in ("delta_swap", "vllm_delta_plugin", "sglang_delta_plugin"):  # another checkout's packages
        (other / name).mkdir(parents=True)
        (other / name / "__init__.py").write_text("raise ImportError('imported the other checkout')\n")
    meta = other / "delta_swap-0.0.1.dist-info"  # its entry points, as an install of it would have
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: delta-swap\nVersion: 0.0.1\n")
    (meta / "entry_points.txt").write_text(
        "[vllm.general_plugins]\ndelta_swap = other:register\n[sglang.srt.plugins]\ndelta_swap = other:register\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(other))
    monkeypatch.chdir(tmp_path)
    code = (
        "import os, importlib.metadata as m, delta_swap, vllm_delta_plugin, sglang_delta_plugin as s; "
        "print(delta_swap.__file__, s.__file__, os.environ['PYTHONPATH'], "
        "*[e.value for g in ('vllm.general_plugins', 'sglang.srt.plugins') "
        "for e in m.entry_points(group=g) if e.name == 'delta_swap'])"
    )
    server = launch_server(["-c", code], {}, tmp_path / "server.log", 0, python=sys.executable)
    assert server.proc.wait(120) == 0, (tmp_path / "server.log").read_text()[-2000:]
    first, plugin, path, *entry_points = (tmp_path / "server.log").read_text().split()
    assert [Path(first).resolve(), Path(plugin).resolve()] == [
        ROOT / "common" / "__init__.py",
        ROOT / "sglang_delta_plugin" / "__init__.py",
    ]
    assert path.split(os.pathsep) == [str(ROOT / ".import-root"), str(other)]
    # The engines load the plugin through entry points: this checkout's, once per group.
    assert entry_points == ["vllm_delta_plugin.plugin:register", "sglang_delta_plugin.plugin:register"]
