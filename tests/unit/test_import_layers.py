"""The package's layers import one way: config -> planner -> scheduler -> runtime -> launchers.

The planner and scheduler run where no GPU stack is installed (``optimus-plan`` on a laptop, the
benchmark), so they import neither torch nor megatron-core, directly or through a lower layer, and
nothing of the runtime. Every import counts, including those inside functions and under
``TYPE_CHECKING``: a function-level import is where a cycle hides (``megatron.py`` <->
``megatron_training.py`` did).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from support.paths import REPO

PACKAGES = ("optimus_mllm", "megatron_patches")
LAYERS = ("config", "planner", "scheduler", "runtime", "launchers")
# A module's layer is that of its longest prefix here; any other module of optimus_mllm (config.py,
# errors.py, cost_model.py, ...) is in the lowest, so that one needing a later layer fails below
# until it is named here.
LAYER_OF_PREFIX = {
    "optimus_mllm.planner": "planner",
    "optimus_mllm.scheduler": "scheduler",
    "optimus_mllm.runtime": "runtime",
    "optimus_mllm.profiler": "runtime",  # measures kernels with torch
    "optimus_mllm.hf_convert": "runtime",  # writes megatron-core checkpoints
    "megatron_patches": "runtime",
    "optimus_mllm.cli": "launchers",
    "optimus_mllm.train": "launchers",
    "optimus_mllm.megatron": "launchers",
    "optimus_mllm.megatron_arguments": "launchers",
    "optimus_mllm.megatron_lm": "launchers",
    "optimus_mllm.megatron_lm_cpu": "launchers",
    "optimus_mllm.megatron_lm_seams": "launchers",
    "optimus_mllm.megatron_flags": "launchers",
    "optimus_mllm.megatron_unread_flags": "launchers",
    "optimus_mllm.megatron_training": "launchers",
}
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


def layer_of(name: str) -> str:
    prefixes = [p for p in LAYER_OF_PREFIX if name == p or name.startswith(p + ".")]
    return LAYER_OF_PREFIX[max(prefixes, key=len)] if prefixes else LAYERS[0]


def _top_level(name: str) -> str:
    return name.partition(".")[0]


def test_the_layer_table_names_existing_modules() -> None:
    """A renamed or removed module leaves no stale entry behind."""
    stale = [
        p for p in LAYER_OF_PREFIX if not any(n == p or n.startswith(p + ".") for n in SOURCES)
    ]
    assert not stale


def test_no_module_imports_a_later_layer() -> None:
    upward = [
        f"{name} ({layer_of(name)}) imports {target} ({layer_of(target)})"
        for name, targets in IMPORTS.items()
        for target in sorted(targets)
        if target in SOURCES and LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(name))
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


PLANNER_AND_SCHEDULER = sorted(n for n in SOURCES if layer_of(n) in ("planner", "scheduler"))


def test_the_planner_and_scheduler_sources_name_no_gpu_stack_and_no_runtime() -> None:
    found = [
        f"{name} imports {target}"
        for name in PLANNER_AND_SCHEDULER
        for target in sorted(IMPORTS[name])
        if _top_level(target) in GPU_STACK or layer_of(target) in ("runtime", "launchers")
    ]
    assert not found, "\n".join(found)


def test_importing_the_planner_and_scheduler_loads_no_torch_and_no_runtime() -> None:
    """Imported for real, one after another in a fresh interpreter: whatever they pull in through
    the layers below (config, cost model) counts too. The first module after which torch,
    megatron-core or the runtime is loaded is named."""
    script = f"""
import importlib, sys

def forbidden(module):
    return module.partition(".")[0] in {GPU_STACK!r} or module.startswith("optimus_mllm.runtime")

for name in {PLANNER_AND_SCHEDULER!r}:
    importlib.import_module(name)
    loaded = sorted(filter(forbidden, sys.modules))
    if loaded:
        sys.exit(f"importing {{name}} loaded {{loaded[:5]}}")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert len(PLANNER_AND_SCHEDULER) > 10  # the table still finds the planner's and scheduler's


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
