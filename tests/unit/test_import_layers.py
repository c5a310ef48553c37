"""The package's layers import one way: config -> costing -> planner -> scheduler -> runtime ->
launchers.

A module's layer is its folder's (``optimus_mllm/costing/...`` is in costing), so a module's place
in the tree says what it may import. The config, cost models, planner and scheduler run where no GPU
stack is installed (``optimus-plan`` on a laptop, the benchmark), so they import neither torch nor
megatron-core, directly or through a lower layer, and nothing of the runtime. Every import counts,
including those inside functions and under ``TYPE_CHECKING``: a function-level import is where a
cycle hides (``megatron/entry.py`` <-> ``megatron/core_training.py`` did).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from support.paths import REPO

PACKAGES = ("optimus_mllm", "megatron_patches")
LAYERS = ("config", "costing", "planner", "scheduler", "runtime", "launchers")
# The layer of each folder of optimus_mllm (a new folder fails below until it is named here), and
# of the few modules at its root; megatron_patches, the one place that patches megatron-core, is
# runtime.
LAYER_OF_FOLDER = {
    "config": "config",
    "costing": "costing",
    "planner": "planner",
    "scheduler": "scheduler",
    "runtime": "runtime",
    "megatron": "launchers",
    "cli": "launchers",
    "tools": "launchers",
}
LAYER_OF_ROOT_MODULE = {
    "optimus_mllm": "config",
    "optimus_mllm.errors": "config",
    "optimus_mllm.train": "launchers",  # python -m optimus_mllm.train, torchrun -m ...
}
NO_GPU_STACK = ("config", "costing", "planner", "scheduler")
GPU_STACK = ("torch", "megatron", "megatron_patches")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
    }


SOURCES = _sources()


def _imported(name: str, path: Path) -> set[str]:
    """Every module ``name``'s source imports, anywhere in it: ``from a import b`` counts as ``a.b``
    where that is a module of ours, else as ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                imported.add(submodule if submodule in SOURCES else base)
    return imported


IMPORTS = {name: _imported(name, path) for name, path in SOURCES.items()}


def layer_of(name: str) -> str | None:
    """The layer of a module of ours from its folder; None for one outside every named folder."""
    if name == "megatron_patches" or name.startswith("megatron_patches."):
        return "runtime"
    if name in LAYER_OF_ROOT_MODULE:
        return LAYER_OF_ROOT_MODULE[name]
    parts = name.split(".")
    if parts[0] == "optimus_mllm" and len(parts) > 1:
        return LAYER_OF_FOLDER.get(parts[1])
    return None


def _top_level(name: str) -> str:
    return name.partition(".")[0]


def test_every_module_is_in_a_named_layer() -> None:
    """A module in a folder not named above, or a new one at the package's root, is placed first."""
    unplaced = [name for name in SOURCES if layer_of(name) is None]
    assert not unplaced, unplaced


def test_the_layer_tables_name_existing_folders_and_modules() -> None:
    """A renamed or removed folder or root module leaves no stale entry behind."""
    stale = [
        folder
        for folder in LAYER_OF_FOLDER
        if not any(n.startswith(f"optimus_mllm.{folder}.") for n in SOURCES)
    ]
    stale += [name for name in LAYER_OF_ROOT_MODULE if name not in SOURCES]
    assert not stale
    assert set(LAYER_OF_FOLDER.values()) | set(LAYER_OF_ROOT_MODULE.values()) <= set(LAYERS)


def test_no_module_imports_a_later_layer() -> None:
    upward = [
        f"{name} ({layer_of(name)}) imports {target} ({layer_of(target)})"
        for name, targets in IMPORTS.items()
        for target in sorted(targets)
        if target in SOURCES
        and LAYERS.index(layer_of(target) or LAYERS[0]) > LAYERS.index(layer_of(name) or LAYERS[0])
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycle() -> None:
    graph = {name: sorted(t for t in targets if t in SOURCES) for name, targets in IMPORTS.items()}
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        path.append(name)
        for target in graph[name]:
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(name)
        return None

    for name in graph:
        cycle = visit(name)
        assert cycle is None, " -> ".join(cycle)


WITHOUT_GPU_STACK = sorted(n for n in SOURCES if layer_of(n) in NO_GPU_STACK)
PLANNER_AND_SCHEDULER = sorted(n for n in SOURCES if layer_of(n) in ("planner", "scheduler"))


def test_the_layers_below_the_runtime_name_no_gpu_stack_and_no_runtime() -> None:
    found = [
        f"{name} imports {target}"
        for name in WITHOUT_GPU_STACK
        for target in sorted(IMPORTS[name])
        if _top_level(target) in GPU_STACK or layer_of(target) in ("runtime", "launchers")
    ]
    assert not found, "\n".join(found)


def test_importing_the_layers_below_the_runtime_loads_no_torch_and_no_runtime() -> None:
    """Imported for real, one after another in a fresh interpreter: whatever they pull in through
    the layers below (config, cost model) counts too. The first module after which torch,
    megatron-core or the runtime is loaded is named."""
    script = f"""
import importlib, sys

def forbidden(module):
    return module.partition(".")[0] in {GPU_STACK!r} or module.startswith("optimus_mllm.runtime")

for name in {WITHOUT_GPU_STACK!r}:
    importlib.import_module(name)
    loaded = sorted(filter(forbidden, sys.modules))
    if loaded:
        sys.exit(f"importing {{name}} loaded {{loaded[:5]}}")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert len(PLANNER_AND_SCHEDULER) > 10  # the folders still hold the planner and scheduler
    assert {"config", "costing"} <= {layer_of(n) for n in WITHOUT_GPU_STACK}


def test_the_production_seams_do_not_import_the_cpu_emulation() -> None:
    """megatron_patches' seams run on GPUs; only the package's apply() reaches the emulation."""
    seams = [n for n in SOURCES if n.startswith("megatron_patches.") and layer_of(n) == "runtime"]
    seams = [n for n in seams if not n.startswith("megatron_patches.cpu")]
    found = [
        f"{name} imports {target}"
        for name in seams
        for target in sorted(IMPORTS[name])
        if target == "megatron_patches.cpu" or target.startswith("megatron_patches.cpu.")
    ]
    assert not found, "\n".join(found)
    assert {"megatron_patches.p2p", "megatron_patches.hooks", "megatron_patches.ddp"} <= set(seams)
