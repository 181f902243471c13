"""The import rules of ARCHITECTURE.md, checked by reading the package's imports.

ARCHITECTURE.md's layer table is the single statement of the rules: this test parses it, so the
document and the code cannot drift apart silently.

- A core layer imports only its own layer and the layers below it (nothing imports upward).
- The core never imports the teaching aids (`book`, `stages`, `training`).
- `kv/` and `sched/` are policy: they import no torch (checked statically and by importing them in a
  fresh interpreter), so the scheduler and the block manager are tested without a model.
- The public surface is vLLM's: `from minivllm import LLM, SamplingParams` works.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "minivllm"
LAYER_ROW = re.compile(
    r"^\|\s*(?P<rank>\d+)\s*\|\s*`(?P<name>[\w.]+)/?`\s*\|\s*(?P<kind>core|aid)\s*\|"
)


def documented_layers() -> dict[str, tuple[int, str]]:
    """name -> (rank, 'core' | 'aid') from ARCHITECTURE.md's layer table."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    layers = {}
    for line in text.splitlines():
        if match := LAYER_ROW.match(line):
            layers[match["name"]] = (int(match["rank"]), match["kind"])
    return layers


LAYERS = documented_layers()


def layer_of(module: str) -> str:
    """'minivllm.kv.block_pool' -> 'kv'; 'minivllm.cli' -> 'cli'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(relative.parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports (absolute names), at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                raise AssertionError(f"{path}: relative import of {node.module}; use minivllm.…")
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


MODULES = package_modules()


def test_the_layer_table_names_every_subpackage() -> None:
    assert LAYERS, "ARCHITECTURE.md has no layer table"
    on_disk = {layer_of(m) for m in MODULES if layer_of(m)}
    assert on_disk == set(LAYERS), (
        f"undocumented: {sorted(on_disk - set(LAYERS))}; gone: {sorted(set(LAYERS) - on_disk)}"
    )


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_of(m)))
def test_nothing_imports_upward(module: str) -> None:
    rank, kind = LAYERS[layer_of(module)]
    for imported in sorted(imports_of(MODULES[module])):
        if not imported.startswith("minivllm.") or imported in {"minivllm"}:
            continue
        target = layer_of(imported)
        if target not in LAYERS:
            continue  # a name imported from the package root's lazy surface
        target_rank, target_kind = LAYERS[target]
        if kind == "core":
            assert target_kind == "core", f"{module} (core) imports the teaching aid {imported}"
        assert target_rank <= rank, f"{module} (layer {rank}) imports upward: {imported}"


@pytest.mark.parametrize("layer", ["kv", "sched"])
def test_policy_layers_import_no_torch_statically(layer: str) -> None:
    for module, path in MODULES.items():
        if layer_of(module) == layer:
            heavy = {i for i in imports_of(path) if i.split(".")[0] in {"torch", "numpy", "numba"}}
            assert not heavy, f"{module} imports {sorted(heavy)}"


def test_policy_layers_import_no_torch_when_run() -> None:
    policy = sorted(m for m in MODULES if layer_of(m) in {"kv", "sched"})
    code = (
        "import importlib, sys\n"
        f"for name in {policy!r}:\n"
        "    importlib.import_module(name)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'numpy'})\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "", f"importing kv/ and sched/ pulled in {result.stdout}"


def test_the_public_surface_is_vllms() -> None:
    import minivllm
    from minivllm import LLM, EngineConfig, RequestOutput, SamplingParams

    assert LLM.__name__ == "LLM" and SamplingParams().max_tokens >= 1
    assert EngineConfig and RequestOutput
    assert sorted(minivllm.__all__) == sorted(minivllm._HOMES)
    for name in minivllm.__all__:
        assert getattr(minivllm, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        minivllm.nope  # noqa: B018
