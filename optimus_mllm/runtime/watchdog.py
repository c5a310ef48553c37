"""One line, not N tracebacks, when a rank stops after the ranks connected.

Once the ranks are connected, an error one of them meets (an image it cannot decode) or a rank that
dies leaves the others blocked in a collective, each then failing with a gloo "Connection closed by
peer" traceback. Through the job's own key-value store (the one ``init_process_group`` rendezvoused
on) the ranks instead agree that the job is over:

- a rank that meets an error of its own marks the job failed, prints its one line if it is the first
  to claim the report, and exits with code 2 (an error every rank agreed on is printed by rank 0 and
  the ranks leave as usual);
- every rank's watchdog thread counts a heartbeat and, once a second, looks for that mark: a rank
  still running when another failed exits at once, with code 2 and nothing printed;
- a rank whose collective breaks without such a mark asks the store which rank stopped counting its
  heartbeat (killed, or crashed before it could say why), marks the job failed and, if first to
  claim the report, names that rank.

A rank that marked the job failed, and rank 0, linger a few heartbeats before they exit, so that the
others have seen the mark while the store (hosted by rank 0 when not under torchrun) is still there.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch.distributed as dist

FAILED = "optimus/failed"
REPORTED = "optimus/reported"
HEARTBEAT_S = 1.0
LINGER_S = 3 * HEARTBEAT_S


def _heartbeat_key(rank: int) -> str:
    return f"optimus/heartbeat/{rank}"


class Watchdog:
    """The report of a failed job, made once, and the exit of every rank within seconds."""

    def __init__(self, prog: str):
        self.prog = prog
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, args=(self.store.clone(),), daemon=True, name="optimus-watchdog"
        )
        self._thread.start()

    def _watch(self, store: dist.Store) -> None:
        key = _heartbeat_key(self.rank)
        while not self._stop.is_set():
            try:
                store.add(key, 1)
                if store.check([FAILED]) and not self._stop.is_set():
                    # another rank failed and said so: this one has nothing to add; rank 0 may host
                    # the store
                    if self.rank == 0:
                        time.sleep(LINGER_S)
                    os._exit(2)
            # the store is gone with its host: the main thread's collective breaks
            except Exception:
                return
            self._stop.wait(HEARTBEAT_S)

    def close(self) -> None:
        """Stop watching (before the process group goes: the thread holds a connection to its
        store)."""
        self._stop.set()
        self._thread.join()

    def fail(self, message: str, agreed: bool = False) -> None:
        """This rank met ``message`` (one line). ``agreed``: every rank raised it
        (``errors.AgreedError``)
        and rank 0 prints it; otherwise mark the job failed, print it if first to report, and exit
        2."""
        if agreed:
            if self.rank == 0:
                print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
            return
        self._stop.set()
        try:
            self.store.set(FAILED, str(self.rank))
            first = self._claim_report()
        except Exception:
            first = True
        self._leave(message if first else None)

    def peer_failed(self) -> None:
        """After this rank's collective broke: if a peer failed or stopped, report it (once) and
        exit 2;
        return when nothing says so (the error is this rank's own)."""
        try:
            if self.store.check([FAILED]):
                self._leave(None)  # the rank that failed said why
            before = self._heartbeats()
            time.sleep(LINGER_S)
            after = self._heartbeats()
        except Exception:  # the store went with its host, rank 0; rank 1 says so
            self._leave(self._stopped_message([0]) if self.rank == 1 else None)
        stopped = [
            rank
            for rank in range(self.world_size)
            if after[rank] == before[rank] and rank != self.rank
        ]
        if not stopped:
            return
        self._stop.set()
        try:
            self.store.set(FAILED, str(stopped[0]))
            first = self._claim_report()
        except Exception:
            first = False
        self._leave(self._stopped_message(stopped) if first else None)

    def _stopped_message(self, stopped: list[int]) -> str:
        return (
            f"rank {', '.join(map(str, stopped))} stopped without a word (killed, or out of "
            "memory?); see its "
            "log and the launcher's report"
        )

    def _leave(self, message: str | None) -> None:
        """Print ``message`` if any, give the other ranks time to see the mark, exit 2 (no teardown:
        the
        peers are gone or going)."""
        if message is not None:
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        time.sleep(LINGER_S)
        os._exit(2)

    def _claim_report(self) -> bool:
        return self.store.compare_set(REPORTED, "", str(self.rank)).decode() == str(self.rank)

    def _heartbeats(self) -> list[int]:
        return [self.store.add(_heartbeat_key(rank), 0) for rank in range(self.world_size)]
