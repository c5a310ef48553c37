"""Launching ``python -m optimus_mllm.train`` from tests: under torchrun, or rank by rank.

Rank by rank (``ranks``, and ``torchrun`` unless told otherwise), each rank is forked from the test
session's fork server, which imported torch, megatron-core and ``optimus_mllm.train`` once
(``distributed_utils.start_context``), and runs ``optimus_mllm.train.main`` as ``python -m
optimus_mllm.train`` would, another module as ``python -m MODULE`` would, or a script as ``python
SCRIPT`` would, with torchrun's environment
variables and its stdout and stderr in files of its own: a fresh interpreter spent 3-4 s of CPU on
those imports per rank (5-7 s with megatron-core's), most of an error test's time on two cores.
Where CUDA is visible the ranks are spawned interpreters, as before.
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from .distributed_utils import PORT_ATTEMPTS, become_rank, free_port, start_context, stop_ranks
from .paths import CONFIGS, REPO

TINY = str(CONFIGS / "tiny.yaml")
TIMEOUT_S = 90
STEP = re.compile(
    r"^step (\d+)/(\d+) \| loss (\d+\.\d{4}) \| grad norm (?:\d+\.\d{4}|skipped \(inf/nan\)) \| "
    r"lr \d\.\d{3}e[-+]\d\d \| (?:loss scale \d+\.\d \| )?[\d.]+ ms \| \d+ tokens/s \| (.+)$"
)
NUMBERS = re.compile(
    r"^step (\d+)/\d+ \| (loss \S+ \| grad norm (?:\S+|skipped \(inf/nan\)) \| lr \S+"
    r"(?: \| loss scale \S+)?) \|"
)
SUMMARY = re.compile(r"^done: (\d+) steps \| mean step [\d.]+ ms \| final loss (\d+\.\d{4})$")


def approx_per_rank(values: list[float | None], rel: float) -> list[object]:
    """``values`` to compare with ``==`` within ``rel``, each ``None`` kept: a rank without the
    last pipeline stage records no loss, and must record none where the reference has none
    (pytest's ``approx`` refuses ``None`` under a relative tolerance since 9.2)."""
    return [None if value is None else pytest.approx(value, rel=rel) for value in values]


def torchrun(*args: str, nproc: int = 4, interpreters: bool = False) -> list[str]:
    """Train ``nproc`` ranks as torchrun starts them; their stdout lines in rank order, after
    checking that every rank exited 0. The ranks fork from the fork server (``ranks``) with
    torchrun's one thread a rank, unless ``interpreters``: then torchrun itself runs them."""
    if interpreters or torch.cuda.is_available():
        return _under_torchrun(args, nproc)
    threads = {"OMP_NUM_THREADS": "1"} if nproc > 1 else {}  # torchrun's default
    environment = {**os.environ, **threads}
    done = ranks(nproc, *args, environment=environment)
    assert [d.returncode for d in done] == [0] * nproc, "".join(
        f"--- rank {rank} exited {d.returncode}:\n{d.stderr[-1500:]}" for rank, d in enumerate(done)
    )
    return [line for d in done for line in d.stdout.splitlines()]


def _under_torchrun(args: tuple[str, ...], nproc: int) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "optimus_mllm.train",
        "--config",
        TINY,
        *args,
    ]
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def step_losses(lines: list[str]) -> dict[int, str]:
    """{step: printed loss} of the step lines."""
    return {int(m.group(1)): m.group(3) for m in map(STEP.match, lines) if m}


def step_numbers(lines: list[str]) -> dict[int, str]:
    """{step: "loss L | grad norm N | lr R[ | loss scale S]"} of the step lines: everything a step's
    update
    decides."""
    return {int(m.group(1)): m.group(2) for m in map(NUMBERS.match, lines) if m}


TRAIN = ("-m", "optimus_mllm.train", "--config", TINY)
Watch = Callable[[list[int], list[Path]], None]  # (each rank's pid, each rank's stdout file)


def ranks(
    world: int,
    *args: str,
    program: tuple[str, ...] = TRAIN,
    interpreters: bool = False,
    environment: dict[str, str] | None = None,
    watch: Watch | None = None,
    nodes: tuple[tuple[str, ...], ...] = ((),),
) -> list[subprocess.CompletedProcess]:
    """Start ``world`` ranks of ``program`` the way torchrun does (its environment variables); wait
    for each. The training program's ranks fork from the fork server unless ``interpreters`` (a
    fresh interpreter each, which also shows what the imports print). ``environment``: the ranks'
    variables before torchrun's, by default this process's. ``watch``: called while forked ranks
    run, with their pids and stdout files (a test that kills a rank mid-run). ``nodes``: each
    node's arguments after ``args``, the ranks split evenly over the nodes in order, as torchrun's
    agents number them (``torchrun_nodes`` launches real agents). The rendezvous port is one the
    OS called free a moment before; where another job took it first (rank 0's store could not
    listen on it), the ranks start again on a new one, up to ``PORT_ATTEMPTS`` times."""
    assert world % len(nodes) == 0, (world, len(nodes))
    launch = _Launch(world, program, interpreters, environment, watch, nodes)
    done = _ranks_on(str(free_port()), args, launch)
    for _ in range(PORT_ATTEMPTS - 1):
        if not any(_PORT_TAKEN in d.stderr.lower() for d in done):
            break
        done = _ranks_on(str(free_port()), args, launch)
    return done


@dataclass(frozen=True)
class _Launch:
    """How ``ranks`` starts its ranks (its arguments)."""

    world: int
    program: tuple[str, ...]
    interpreters: bool
    environment: dict[str, str] | None
    watch: Watch | None
    nodes: tuple[tuple[str, ...], ...]

    @property
    def per_node(self) -> int:
        return self.world // len(self.nodes)


# what torch's TCPStore says when its port was taken between free_port and its listen
_PORT_TAKEN = "address already in use"


def _ranks_on(
    port: str, args: tuple[str, ...], launch: _Launch
) -> list[subprocess.CompletedProcess]:
    world = launch.world
    environments = [
        {
            **(os.environ if launch.environment is None else launch.environment),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % launch.per_node),
            "GROUP_RANK": str(rank // launch.per_node),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(launch.per_node),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        for rank in range(world)
    ]
    argvs = [[*args, *launch.nodes[rank // launch.per_node]] for rank in range(world)]
    program = launch.program
    forkable = program[0] == "-m" or (len(program) == 1 and program[0].endswith(".py"))
    if forkable and not launch.interpreters and not torch.cuda.is_available():
        return _forked_ranks(program, [[*program[2:], *a] for a in argvs], environments, launch)
    assert launch.watch is None, "a watch needs forked ranks"
    procs = []
    for env, argv in zip(environments, argvs):
        procs.append(
            subprocess.Popen(
                [sys.executable, *program, *argv],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return communicate_all(procs)


def _program_rank(
    program: tuple[str, ...], argv: list[str], environment: dict[str, str], out: str, err: str
) -> None:
    """One rank of ``python -m optimus_mllm.train argv``, ``python -m MODULE argv`` or ``python
    SCRIPT argv`` in a forked process: its environment, working directory and output files, then
    the program's exit code as the process's."""
    become_rank(environment)
    if "OMP_NUM_THREADS" in environment:  # read by torch at import, in the server before the fork
        torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))
    os.chdir(REPO)
    for path, fd in ((out, 1), (err, 2)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file, fd)
        os.close(file)
    try:
        if program == TRAIN:
            sys.argv = [str(REPO / "optimus_mllm" / "train.py"), *argv]
            from optimus_mllm.train import main

            code = main(argv)
        elif program[0] == "-m":  # python -m MODULE: run as __main__, argv[0] its file
            sys.argv = [program[1], *argv]
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
            code = 0
        else:
            (script,) = program
            sys.argv = [script, *argv]
            sys.path.insert(0, str(Path(script).resolve().parent))  # as ``python SCRIPT`` does
            runpy.run_path(script, run_name="__main__")
            code = 0
    except SystemExit as exit_:  # argparse's usage errors, a script's sys.exit
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then exit 1
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def _forked_ranks(
    program: tuple[str, ...],
    argvs: list[list[str]],
    environments: list[dict[str, str]],
    launch: _Launch,
) -> list[subprocess.CompletedProcess]:
    """``ranks`` of ``program`` (the training program or a script), forked from the fork server;
    killed after ``TIMEOUT_S``."""
    context = start_context()
    with tempfile.TemporaryDirectory() as tmp:
        files = [(f"{tmp}/{rank}.out", f"{tmp}/{rank}.err") for rank in range(len(environments))]
        processes = [
            # not daemonic: megatron-core's checkpoint writer starts processes of its own
            context.Process(target=_program_rank, args=(program, argv, env, *paths), daemon=False)
            for argv, env, paths in zip(argvs, environments, files)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + TIMEOUT_S
        try:
            # until all exit, or one could not listen on the port: the others would wait for its
            # store until the deadline, and ``ranks`` starts them all again on another port
            while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
                if any(
                    p.exitcode and _PORT_TAKEN in Path(err).read_text(errors="replace").lower()
                    for p, (_, err) in zip(processes, files)
                ):
                    break
                if launch.watch is not None:
                    launch.watch([p.pid for p in processes], [Path(out) for out, _ in files])
                time.sleep(0.05)
        finally:
            stop_ranks(processes, join_s=0)
        return [
            subprocess.CompletedProcess(
                [sys.executable, *program[:2], *argv],
                process.exitcode,
                Path(out).read_text(errors="replace"),
                Path(err).read_text(errors="replace"),
            )
            for process, argv, (out, err) in zip(processes, argvs, files)
        ]


def torchrun_nodes(*node_args: tuple[str, ...], nproc: int = 2) -> list[subprocess.Popen]:
    """Start one torchrun agent of ``nproc`` ranks per tuple of ``node_args`` (that node's arguments
    to the training), each a "node" on this machine, launched as on a cluster: every agent on its
    own, meeting the others through torchrun's c10d rendezvous at one endpoint (the first agent to
    bind it hosts the store), which assigns the node ranks. ``communicate_all`` waits for them."""
    port = free_port()
    launcher = (
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(len(node_args)),
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"optimus-test-{port}",
    )
    return [
        subprocess.Popen(
            [*launcher, *TRAIN, *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in node_args
    ]


def communicate_all(procs: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    """Wait for every process, ``TIMEOUT_S`` in all; kill what is left on the way out."""
    deadline = time.monotonic() + TIMEOUT_S
    try:
        outputs = [p.communicate(timeout=max(deadline - time.monotonic(), 1)) for p in procs]
        return [
            subprocess.CompletedProcess(p.args, p.returncode, *out)
            for p, out in zip(procs, outputs)
        ]
    finally:
        for p in procs:
            p.kill()


def assert_one_error_everywhere(
    results: list[subprocess.CompletedProcess], expected: str, prog: str = "optimus-train"
) -> None:
    """Every rank exited 2, and rank 0 alone printed anything: one error line with ``expected`` (no
    traceback,
    no library warning)."""
    assert [r.returncode for r in results] == [2] * len(results), [r.stderr for r in results]
    errors = [
        line
        for r in results
        for line in r.stderr.splitlines()
        if line.startswith(f"{prog}: error:")
    ]
    assert len(errors) == 1 and expected in errors[0], errors
    assert results[0].stderr.splitlines() == errors, results[0].stderr
    assert all(r.stderr == "" for r in results[1:]), [r.stderr for r in results[1:]]


def plain_vision_model(config: object) -> tuple[object, object]:
    """The tiny encoder as a plain megatron-core job builds it: ``CLIPViTModel`` (its ``internvit``
    subtype without a class token) over the local ViT layer, with the norms saved under the fused
    names megatron-core's GPT local spec uses, and LLaVA's ``MultimodalProjector``."""
    from dataclasses import replace

    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    spec = get_vit_layer_with_local_spec()
    spec = replace(
        spec,
        submodules=replace(
            spec.submodules,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )
    vit = replace(
        config,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        kv_channels=8,
    )
    clip = CLIPViTModel(
        vit,
        spec,
        add_class_token=False,
        class_token_len=0,
        patch_dim=4,
        img_h=16,
        img_w=16,
        model_subtype="internvit",
    )
    projection = replace(config, ffn_hidden_size=config.hidden_size, kv_channels=16)
    projector = MultimodalProjector(
        projection,
        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        "mlp",
        32,
    )
    return clip, projector


def encoder_under_megatron_names(stage: object, name: str) -> dict:
    """An encoder's parameters (of an ``EncoderStage`` holding all its layers) keyed as LLaVA's
    ``vision_model.`` (CLIPViTModel) and ``vision_projection.`` (MultimodalProjector) name them."""
    named = {}
    for key, param in stage.encoders[name].named_parameters():
        key = key.replace("patch_embed.", "vision_model.").replace(
            "layers.", "vision_model.decoder.layers."
        )
        named[key.replace("projector.projection.", "vision_projection.")] = param
    return named
