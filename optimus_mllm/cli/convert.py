"""Convert Hugging Face-style GPT-2 / ViT weights into a checkpoint that optimus-train starts from.

    optimus-convert --config configs/tiny.yaml --gpt2 gpt2/model.safetensors \\
        --vit vit=vit/pytorch_model.bin --out pretrained
    torchrun --nproc-per-node 4 -m optimus_mllm.train --config configs/tiny.yaml \\
        --pretrained-checkpoint pretrained

Each input is a state dict file (``.safetensors`` needs the safetensors package; ``.bin`` / ``.pt``
are read with ``torch.load(weights_only=True)``) or a folder of them. The output is a megatron-core
dist checkpoint of whole tensors under this project's (LLaVA's) keys, which loads into any parallel
plan; ``--pretrained-llm`` / ``--pretrained-encoder NAME=DIR`` take one part of it. The mapping is
documented in ``optimus_mllm/tools/hf_convert.py``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from optimus_mllm.cli.common import (
    ArgumentParser,
    add_config_arguments,
    quiet_library_warnings,
    run,
)
from optimus_mllm.config import load_config
from optimus_mllm.errors import OptimusError
from optimus_mllm.tools.hf_convert import gpt2_entries, save_dist_checkpoint, vit_entries

PROG = "optimus-convert"


def _read_state(path: Path, flag: str) -> dict[str, torch.Tensor]:
    files = (
        sorted([*path.glob("*.safetensors"), *path.glob("*.bin"), *path.glob("*.pt")])
        if path.is_dir()
        else [path]
    )
    if not files or not all(f.is_file() for f in files):
        raise OptimusError(
            f"{flag} {path}: no state dict there; give a .safetensors, .bin or .pt file or a "
            "folder "
            "of them"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                state.update(load_file(str(file)))
            else:
                state.update(torch.load(file, map_location="cpu", weights_only=True))
        except ImportError:
            raise OptimusError(
                f"{flag} {file}: reading .safetensors needs the safetensors package; "
                "pip install safetensors"
            ) from None
        except Exception as exc:  # a corrupt or foreign file: say which, in one line
            raise OptimusError(
                f"{flag} {file}: not a readable state dict ({type(exc).__name__})"
            ) from None
    return state


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog=PROG,
        description="Hugging Face GPT-2 / ViT weights -> an optimus-train pretrained checkpoint",
    )
    add_config_arguments(parser, "configs/tiny.yaml")
    parser.add_argument("--gpt2", metavar="FILE", help="GPT-2 state dict for the LLM")
    parser.add_argument(
        "--vit",
        metavar="NAME=FILE",
        action="append",
        default=[],
        help="ViT state dict for encoder NAME (with LLaVA's multi_modal_projector, the projector "
        "too); repeat for several",
    )
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="the checkpoint folder to create"
    )
    args = parser.parse_args(argv)
    quiet_library_warnings(torch.cuda.is_available())
    return run(PROG, lambda: _convert(args))


def _convert(args) -> int:
    from optimus_mllm.runtime.sharded_state import encoder_prefix

    config = load_config(args.config, args.override)
    out = Path(args.out)
    if out.exists():
        raise OptimusError(f"--out {out} exists; give a new folder")
    if not args.gpt2 and not args.vit:
        raise OptimusError("nothing to convert; give --gpt2 FILE and/or --vit NAME=FILE")
    entries = gpt2_entries(_read_state(Path(args.gpt2), "--gpt2"), config.llm) if args.gpt2 else []
    encoders = {e.name: e for e in config.encoders}
    for given in args.vit:
        name, sep, file = given.partition("=")
        if not sep or name not in encoders or not file:
            raise OptimusError(
                f"--vit {given!r}: give NAME=FILE with NAME one of the config's encoders "
                f"({', '.join(encoders)})"
            )
        entries += vit_entries(
            _read_state(Path(file), "--vit"), encoders[name], encoder_prefix(config, name)
        )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    import megatron_patches

    # this process is the group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    megatron_patches.apply()  # the checkpoint writer's CUDA spots, on a host without CUDA
    try:
        save_dist_checkpoint(entries, str(tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        megatron_patches.remove()
        dist.destroy_process_group()
    tmp.rename(out)
    parts = (["llm"] if args.gpt2 else []) + [given.partition("=")[0] for given in args.vit]
    print(f"wrote {out}: {', '.join(parts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
