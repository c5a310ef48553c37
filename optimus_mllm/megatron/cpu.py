"""Run one of Megatron-LM's own training scripts, unmodified, on a host without CUDA.

    torchrun --nproc-per-node 4 -m optimus_mllm.megatron.cpu \\
        $MEGATRON_LM_DIR/pretrain_vlm.py --distributed-backend gloo --transformer-impl local ...

installs the CPU patches for megatron-core and Megatron-LM's ``megatron.training``
(``megatron_patches.cpu.training``; nothing where CUDA is available) and runs the script as
``python SCRIPT ARGS`` would: as ``__main__``, with its folder first on ``sys.path`` and ``ARGS`` as
its ``sys.argv``. ``MEGATRON_LM_DIR``, when set, goes last on the path, for a script kept outside
the checkout (``megatron.training``, ``pretrain_gpt``). megatron-core is the installed one (imported
before the checkout is on the path; Megatron-LM's tag ``core_v0.16.1`` goes with megatron-core
0.16.1), ``megatron.training`` the checkout's.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from optimus_mllm.cli.common import quiet_library_warnings, run
from optimus_mllm.errors import OptimusError

_PROG = "optimus_mllm.megatron.cpu"


def _run_script(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        raise OptimusError(
            "give the Megatron-LM script to run first, e.g. $MEGATRON_LM_DIR/pretrain_vlm.py ARGS"
        )
    script = Path(argv[0]).resolve()
    if not script.is_file():
        raise OptimusError(f"{argv[0]}: no such script (a Megatron-LM checkout's pretrain_*.py)")

    import torch

    quiet_library_warnings(cuda_available=torch.cuda.is_available())
    import megatron.core  # noqa: F401  the installed megatron-core, before the checkout's

    sys.path.insert(0, str(script.parent))
    if os.environ.get("MEGATRON_LM_DIR"):
        sys.path.append(os.environ["MEGATRON_LM_DIR"])
    try:
        import megatron.training  # noqa: F401
    except ImportError as error:
        raise OptimusError(
            f"{script.parent} does not give megatron.training ({error}); run a script of a "
            "Megatron-LM checkout (tag core_v0.16.1 for megatron-core 0.16.1) with "
            "pip install 'optimus-mllm[megatron-lm]'"
        ) from error

    import megatron_patches.cpu.training as training_cpu

    try:
        training_cpu.apply()
    except training_cpu.MegatronPatchError as error:
        raise OptimusError(f"{error}; use the Megatron-LM tag of this megatron-core") from error
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(_PROG, lambda: _run_script(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
