"""Record the point-to-point calls a rank makes, and hold them to NCCL's matching rules.

gloo matches a send with a receive by (peer, tag); NCCL ignores tags and matches by order on each
communicator, and a communicator whose two ranks both send first can deadlock. ``recorded_p2p``
records every ``send`` / ``recv`` / ``isend`` / ``irecv`` of ``torch.distributed`` made inside it as
``(op, group, me, peer, shape, dtype, tag)``; ``nccl_violations`` checks the records of all ranks:
no tags, no P2P on the default group, one direction per group, and on every group the k-th send
and the k-th receive agree in shape and dtype. Used by tests/distributed/test_nccl_matching.py and
tests/support/check_plans.py.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch.distributed as dist

P2P_OPS = ("send", "recv", "isend", "irecv")
Record = tuple  # (op, group name, me, peer, shape, dtype, tag)


@contextlib.contextmanager
def recorded_p2p() -> Iterator[list[Record]]:
    """Every P2P call of ``torch.distributed`` inside the block, appended to the yielded list."""
    records: list[Record] = []
    me = dist.get_rank()

    def recording(op: str, original):
        # positional, or by torch's names (megatron-core's own P2P: tensor=, dst=/src=)
        def call(*args, **kwargs):
            tensor = args[0] if args else kwargs["tensor"]
            peer = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
            group, tag = kwargs.get("group"), kwargs.get("tag", 0)
            name = "default" if group is None or group == dist.group.WORLD else group.group_name
            records.append((op, name, me, peer, tuple(tensor.shape), str(tensor.dtype), tag))
            return original(*args, **kwargs)

        return call

    originals = {op: getattr(dist, op) for op in P2P_OPS}
    for op, original in originals.items():
        setattr(dist, op, recording(op, original))
    try:
        yield records
    finally:
        for op, original in originals.items():
            setattr(dist, op, original)


def nccl_violations(records: list[Record]) -> list[str]:
    """What NCCL would match differently from gloo, or could deadlock on, in these P2P records."""
    problems = []
    # (group, sender, receiver) -> [(shape, dtype)]
    sends: dict[tuple[str, int, int], list] = defaultdict(list)
    recvs: dict[tuple[str, int, int], list] = defaultdict(list)
    directions: dict[str, set] = defaultdict(set)
    for op, group, me, peer, shape, dtype, tag in records:
        if tag:
            problems.append(f"{op} from rank {me} uses tag {tag}: NCCL ignores tags")
        if group == "default":
            problems.append(
                f"{op} on rank {me} goes over the default group, shared by every kind of message"
            )
        if op in ("send", "isend"):
            sends[(group, me, peer)].append((shape, dtype))
            directions[group].add((me, peer))
        else:
            recvs[(group, peer, me)].append((shape, dtype))
    for group, ways in directions.items():
        if len(ways) > 1:
            problems.append(
                f"group {group} carries sends both ways {sorted(ways)}: opposing sends can deadlock"
            )
    for key in sends.keys() | recvs.keys():
        if sends[key] != recvs[key]:
            problems.append(
                f"group {key[0]} from rank {key[1]} to {key[2]}: sends {sends[key]} but receives "
                f"{recvs[key]} in order"
            )
    return problems
