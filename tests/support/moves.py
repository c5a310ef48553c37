"""Pipeline moves that reuse no backward placement by what it sees: the plain search, for tests
that check the reuse against it."""

from __future__ import annotations

from optimus_mllm.scheduler.fine import PipelineMoves


class _Forgetful(dict):
    """A dict that keeps nothing."""

    def __setitem__(self, key, value) -> None:
        pass


class UnseenMoves(PipelineMoves):
    """``PipelineMoves`` without ``backward_seen``: every backward move whose exact history is new
    is placed again."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.backward_seen = _Forgetful()
