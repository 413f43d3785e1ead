"""The layer map in delta_swap's docstring is the package as it is: every module of common/ is in
exactly one layer, every name in the map exists, and no module imports from a layer above its own."""

from __future__ import annotations

import ast
from pathlib import Path

import delta_swap

ROOT = Path(delta_swap.__file__).resolve().parent


def _layer_map() -> list[tuple[str, str]]:
    """(layer, unit) in map order; a unit is a module path like ``rebuild`` or
    ``integrations/hf_names``, or a folder ending in ``/``."""
    doc = delta_swap.__doc__ or ""
    block = doc.split("::\n\n", 1)[1].split("\n\n", 1)[0]
    units, layer = [], ""
    for line in block.splitlines():
        layer = line[4:13].strip() or layer
        names = line[13:36].strip()
        units += [(layer, name.strip()) for name in names.split(",") if name.strip()]
    return units


def _unit_of(module: str, units: list[str]) -> str | None:
    """The most specific unit holding ``module`` (a path relative to common/, no suffix)."""
    candidates = [u for u in units if module == u or (u.endswith("/") and module.startswith(u))]
    return max(candidates, key=len, default=None)


def _modules() -> dict[str, Path]:
    """Every module of the package, by path relative to common/ (``__init__`` of a folder is the folder's)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("").as_posix()
        if rel != "__init__":
            out[rel] = path
    return out


def _imports(module: str, path: Path) -> set[str]:
    """The package modules ``module`` imports (relative or ``delta_swap.`` imports), as paths."""
    package = module.split("/")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[: len(package) - (node.level - 1)]
        elif node.module and (node.module == "delta_swap" or node.module.startswith("delta_swap.")):
            base = []
        else:
            continue
        name = node.module or ""
        if not node.level:
            name = name.removeprefix("delta_swap").lstrip(".")
        stem = base + [part for part in name.split(".") if part]
        for alias in node.names:  # `from . import codec` names a module, `from .x import y` names y in x
            candidate = "/".join([*stem, alias.name])
            found.add(
                candidate if (ROOT / f"{candidate}.py").exists() or (ROOT / candidate).is_dir() else "/".join(stem)
            )
    return {f for f in found if f}


def test_every_module_is_in_exactly_one_layer_and_every_mapped_name_exists() -> None:
    mapped = _layer_map()
    units = [u for _, u in mapped]
    assert len(units) == len(set(units)), "a name appears twice in the layer map"
    for unit in units:
        assert (ROOT / unit).is_dir() if unit.endswith("/") else (ROOT / f"{unit}.py").is_file(), unit
    unmapped = [m for m in _modules() if _unit_of(m, units) is None]
    assert not unmapped, f"modules missing from the layer map in common/__init__.py: {unmapped}"


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    mapped = _layer_map()
    order = list(dict.fromkeys(layer for layer, _ in mapped))
    rank = {unit: order.index(layer) for layer, unit in mapped}
    units = list(rank)
    upward = []
    for module, path in _modules().items():
        own = _unit_of(module, units)
        for target in _imports(module, path):
            other = _unit_of(target, units) or _unit_of(target + "/", units)
            assert other is not None, f"{module} imports {target}, which is not in the layer map"
            if rank[other] > rank[own]:
                upward.append(f"{module} ({order[rank[own]]}) imports {target} ({order[rank[other]]})")
    assert not upward, upward
