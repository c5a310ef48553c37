"""The checks of ``scripts/gpu_truth.sh --preflight``: will the device run go through?

    python3 scripts/gpu_preflight.py --steps TABLE --out-dir DIR --command-limit S --install-limit S
        --kill-after S

A GPU is lent for minutes, with no network, one command of at most ``--command-limit`` seconds and
at most 64 MiB travelling with the tree, and its files come back only from ``$OUT`` (at most 8).
Here, without a GPU, this checks that:

1. ``.whl/`` is ignored by git, and holds one wheel of each line of ``scripts/gpu_wheels.txt``
   (fetched with ``scripts/fetch_gpu_wheels.sh`` when missing), megatron-core's for CPython 3.12
   and at the version installed here, the one the tests pass with;
2. the carried megatron-core exposes every name the project imports from it (its wheel unpacked
   and imported here), and every program the device run starts imports under the versions
   installed here (``--help``; the GPU tests collected, with the carried pytest-timeout);
3. every step has a time limit and the limits, with the wheels' install, fit one command;
4. the run writes no more files than come back, and what travels (files git would send, shared/,
   ``.whl/``) stays under the carry limit;

then prints the device call. ``TABLE`` is gpu_truth.sh's list of steps: per line a name, its limit
in seconds and its command's arguments, tab-separated, the arguments joined by ``\\x1f``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WHEELS, WHEEL_LIST = REPO / ".whl", REPO / "scripts" / "gpu_wheels.txt"
CARRY_LIMIT = 64 << 20  # bytes that may travel with the tree
FILES_BACK = 8  # files that come back from $OUT
DEVICE_PYTHON = "cp312"
MARGIN_S = 30  # of a command's limit, for the shell, the transfers and the log's flush
SCANNED = ("optimus_mllm", "megatron_patches", "scripts", "benchmarks", "tests")


class PreflightError(Exception):
    """A check failed: the device run would not go through as it stands."""


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: int
    argv: tuple[str, ...]


def read_steps(table: Path) -> list[Step]:
    steps = []
    for line in table.read_text().splitlines():
        name, limit, command = line.split("\t", 2)
        if not limit.isdigit() or int(limit) <= 0:
            raise PreflightError(f"step {name} has no time limit (got {limit!r})")
        steps.append(Step(name, int(limit), tuple(command.split("\x1f"))))
    return steps


# -- 1. wheels -----------------------------------------------------------------------------------


def wanted_wheels() -> dict[str, str]:
    """scripts/gpu_wheels.txt: normalised name -> version."""
    wanted = {}
    for line in WHEEL_LIST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            wanted[_normalise(name)] = version
    return wanted


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_files() -> dict[str, list[Path]]:
    """The wheels in .whl/ by normalised name."""
    found: dict[str, list[Path]] = {}
    for path in sorted(WHEELS.glob("*.whl")):
        found.setdefault(_normalise(path.name.split("-")[0]), []).append(path)
    return found


def check_wheels() -> dict[str, Path]:
    """One wheel per wanted name and version, fetched when one is missing."""
    _check_ignored()
    wanted = wanted_wheels()
    if any(name not in wheel_files() for name in wanted):
        fetch = subprocess.run(
            ["bash", str(REPO / "scripts" / "fetch_gpu_wheels.sh")],
            capture_output=True,
            text=True,
        )
        if fetch.returncode != 0:
            tail = (fetch.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise PreflightError(f"scripts/fetch_gpu_wheels.sh could not download them: {tail}")
    found, chosen = wheel_files(), {}
    for name, version in wanted.items():
        paths = found.get(name, [])
        if len(paths) != 1:
            raise PreflightError(
                f".whl/ holds {len(paths)} wheels of {name} ({[p.name for p in paths]}); it needs "
                "exactly one (two stop the install there): remove the others"
            )
        parts = paths[0].name[: -len(".whl")].split("-")
        if parts[1] != version:
            raise PreflightError(
                f".whl/{paths[0].name} is not {name}=={version} (scripts/gpu_wheels.txt); "
                "delete it and run scripts/fetch_gpu_wheels.sh"
            )
        if parts[-2] != "none" and not parts[-2].startswith(DEVICE_PYTHON):
            raise PreflightError(f".whl/{paths[0].name} is not built for the device's CPython 3.12")
        chosen[name] = paths[0]
    here = importlib.metadata.version("megatron-core")
    if wanted["megatron_core"] != here:
        raise PreflightError(
            f"scripts/gpu_wheels.txt carries megatron-core {wanted['megatron_core']}, but the "
            f"tests here run {here}: carry the version they pass with"
        )
    return chosen


def _check_ignored() -> None:
    probe = subprocess.run(["git", "check-ignore", "-q", ".whl/probe.whl"], cwd=REPO)
    tracked = _git_files("--cached", "--", ".whl")
    if probe.returncode != 0 or tracked:
        raise PreflightError(".whl/ must be ignored by git and hold no tracked file (.gitignore)")


# -- 2. imports ----------------------------------------------------------------------------------


def megatron_imports() -> dict[str, set[str]]:
    """Every ``from megatron.core... import NAME`` and ``import megatron.core...`` of the project:
    module -> names."""
    imports: dict[str, set[str]] = {}
    for folder in SCANNED:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "megatron.core"
                ):
                    imports.setdefault(node.module, set()).update(a.name for a in node.names)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name.startswith("megatron.core"):
                            imports.setdefault(alias.name, set())
    return imports


_RESOLVE = """
import importlib, json, sys
imports, root = json.loads(sys.argv[1]), sys.argv[2]
import megatron.core as core
assert core.__file__.startswith(root), core.__file__
missing = []
for module, names in imports.items():
    try:
        found = importlib.import_module(module)
    except Exception as error:
        missing.append(f"{module} ({type(error).__name__}: {error})")
        continue
    for name in names:
        if not hasattr(found, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
print(json.dumps({"version": core.__version__, "missing": missing}))
"""


def check_carried_megatron(wheel: Path, version: str) -> str:
    """The carried megatron-core, unpacked and imported here, exposes every name the project
    imports."""
    imports = megatron_imports()
    with tempfile.TemporaryDirectory() as root:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(root)
        env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{REPO}", "PYTHONWARNINGS": "ignore"}
        listed = json.dumps({m: sorted(n) for m, n in imports.items()})
        result = _python_json(
            _RESOLVE, [listed, root], env, f"importing the carried {wheel.name} failed"
        )
    if result["version"] != version or result["missing"]:
        raise PreflightError(
            f"the carried megatron-core {result['version']} lacks what the project imports: "
            f"{result['missing']}"
        )
    names = sum(len(n) or 1 for n in imports.values())
    return f"carried megatron-core {version}: {names} names from {len(imports)} modules resolve"


# Every program's probe in one interpreter (an interpreter per probe imported torch each time:
# seconds of CI apiece): ``--help`` run as ``python3 -m MODULE`` or ``python3 SCRIPT`` runs it,
# the GPU tests collected through pytest's API. A script's folder leaves sys.path with it, and
# what it imported from there sys.modules, so that no later program finds a module its own path
# would not.
_PROBE = """
import json, pathlib, runpy, sys
failed = {}
for name, argv in json.loads(sys.argv[1]):
    path, before = list(sys.path), set(sys.modules)
    folder = None if argv[0] == "-m" else str(pathlib.Path(argv[0]).resolve().parent)
    try:
        if argv[:2] == ["-m", "pytest"]:
            import pytest
            code = pytest.main(argv[2:])
        else:
            sys.argv = argv[1:] if folder is None else argv  # argv[0]: the module or script
            try:
                if folder is None:
                    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
                else:
                    sys.path.insert(0, folder)
                    runpy.run_path(argv[0], run_name="__main__")
                code = 0
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        if code:
            failed[name] = f"exit {code}"
    except BaseException as error:
        failed[name] = f"{type(error).__name__}: {error}"
    sys.path[:] = path
    for module in set(sys.modules) - before:
        if folder and (getattr(sys.modules[module], "__file__", None) or "").startswith(folder):
            del sys.modules[module]
print(json.dumps(failed))
"""


def check_programs(steps: list[Step], pytest_timeout: Path) -> list[str]:
    """Every Python program a step starts imports here: ``--help``, or the tests collected."""
    probes: dict[tuple[str, ...], str] = {}  # a program several steps start is probed once
    for step in steps:
        argv = list(step.argv)
        if argv[0] != "python3":
            continue
        if argv[1:3] == ["-m", "pytest"]:
            probe = (*argv[1:], "--collect-only", "-q")
        else:  # python3 -m MODULE ... / python3 SCRIPT ...
            probe = (*argv[1:3], "--help") if argv[1] == "-m" else (argv[1], "--help")
        probes.setdefault(probe, step.name)
    with tempfile.TemporaryDirectory() as site:
        install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        install += ["--disable-pip-version-check", "--root-user-action=ignore"]
        subprocess.run([*install, "--target", site, str(pytest_timeout)], check=True, timeout=120)
        env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
        listed = json.dumps([(name, list(probe)) for probe, name in probes.items()])
        failed = _python_json(_PROBE, [listed], env, "probing the steps' programs failed")
    for probe, name in probes.items():
        if name in failed:
            raise PreflightError(f"step {name}: python3 {' '.join(probe)}: {failed[name]}")
    return [s.name for s in steps if s.argv[0] == "python3"]


def _python_json(program: str, args: list[str], env: dict[str, str], failure: str) -> Any:
    """``python -c program args`` in the repository with ``env``: the JSON its last line of
    output holds; where it fails, ``failure`` and its last line of output."""
    proc = subprocess.run(
        [sys.executable, "-c", program, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    if proc.returncode != 0:
        raise PreflightError(f"{failure}: {_last_line(proc)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr or proc.stdout or "").strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}"


# -- 3. time, 4. files ---------------------------------------------------------------------------


def run_limit_s(steps: list[Step], install_limit_s: int, kill_after_s: int) -> int:
    """The longest the device run can take: the install, and each step to its limit and kill."""
    return install_limit_s + sum(step.limit_s + kill_after_s for step in steps)


def check_time(steps: list[Step], install_limit_s: int, kill_after_s: int, command_s: int) -> int:
    longest = run_limit_s(steps, install_limit_s, kill_after_s)
    if longest > command_s - MARGIN_S:
        raise PreflightError(
            f"the steps' time limits add up to {longest} s with the install; one device command "
            f"is {command_s} s and {MARGIN_S} s are kept for the rest: lower the limits in "
            "scripts/gpu_truth.sh or split the run"
        )
    return longest


def check_outputs(steps: list[Step], out_dir: str) -> list[str]:
    """The files the run leaves in OUT: the log and every step argument naming a file there."""
    prefix = out_dir.rstrip("/") + "/"
    files = {"gpu_truth.log"} | {
        arg[len(prefix) :] for step in steps for arg in step.argv if arg.startswith(prefix)
    }
    if len(files) > FILES_BACK or any(f.count("/") > 2 for f in files):
        raise PreflightError(
            f"the run leaves {len(files)} files in OUT ({sorted(files)}); at most {FILES_BACK}, "
            "at most two folders down, come back"
        )
    return sorted(files)


def carried_bytes() -> dict[str, int]:
    """What travels: the files git would send (tracked, and untracked not ignored), shared/, and
    .whl/."""
    tree = set(_git_files("--cached", "--others", "--exclude-standard"))
    shared = {str(p.relative_to(REPO)) for p in (REPO / "shared").rglob("*") if p.is_file()}
    wheels = {str(p.relative_to(REPO)) for p in WHEELS.glob("*") if p.is_file()}
    return {
        "tree": _size(tree - shared - wheels),
        "shared": _size(shared),
        ".whl": _size(wheels),
    }


def _git_files(*args: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", *args], cwd=REPO, capture_output=True, check=True
    ).stdout
    return [name for name in out.decode().split("\0") if name]


def _size(paths: set[str]) -> int:
    return sum(
        (REPO / p).lstat().st_size for p in paths if (REPO / p).is_symlink() or (REPO / p).exists()
    )


def check_carry() -> str:
    sizes = carried_bytes()
    total = sum(sizes.values())
    if total > CARRY_LIMIT:
        raise PreflightError(
            f"{total / 2**20:.1f} MiB would travel ({_mib(sizes)}), over the 64 MiB limit"
        )
    return f"{total / 2**20:.1f} MiB of 64 MiB ({_mib(sizes)})"


def _mib(sizes: dict[str, int]) -> str:
    return ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in sizes.items())


# -- the run -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_truth.sh --preflight")
    parser.add_argument("--steps", type=Path, required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--command-limit", type=int, required=True)
    parser.add_argument("--install-limit", type=int, required=True)
    parser.add_argument("--kill-after", type=int, required=True)
    args = parser.parse_args(argv)
    say = print
    try:
        steps = read_steps(args.steps)
        wheels = check_wheels()
        versions = {n: w.name.split("-")[1] for n, w in wheels.items()}
        say(f"wheels: {', '.join(w.name for w in wheels.values())}")
        say(check_carried_megatron(wheels["megatron_core"], versions["megatron_core"]))
        here = {n: importlib.metadata.version(n) for n in ("torch", "megatron-core")}
        tested = check_programs(steps, wheels["pytest_timeout"])
        say(f"imports here ({_versions(here)}): {', '.join(tested)}")
        longest = check_time(steps, args.install_limit, args.kill_after, args.command_limit)
        say(
            f"time limits (s): install {args.install_limit}, "
            + ", ".join(f"{s.name} {s.limit_s}" for s in steps)
            + f"; each step killed {args.kill_after} s after its limit"
        )
        say(f"longest run: {longest} s of one {args.command_limit} s command")
        say(f"files back from OUT: {', '.join(check_outputs(steps, args.out_dir))}")
        say(f"carry: {check_carry()}")
    except PreflightError as error:
        print(f"gpu_truth.sh --preflight: FAILED: {error}", file=sys.stderr)
        return 1
    timeout_s = min(args.command_limit, longest + MARGIN_S)
    say("preflight passed; the device call:")
    say(f'run(command="bash scripts/gpu_truth.sh", carry=[".whl"], timeout_s={timeout_s})')
    return 0


def _versions(versions: dict[str, str]) -> str:
    return ", ".join(f"{name} {version}" for name, version in versions.items())


if __name__ == "__main__":
    sys.exit(main())
