"""Dead ranks: a heartbeat over the rendezvous store, so that no rank waits for a dead one.

A rank that dies (SIGKILL, the OOM killer, a segfault) leaves the others blocked in their next
collective until ``train.dist_timeout_s`` (10 minutes by default), and then each fails with a
message about a timeout that does not say who is gone. A short collective timeout would also kill
a slow but live step. Instead every rank runs a daemon thread that, every INTERVAL_S seconds:

    beats      sets ``beat/<rank>`` to "<counter> <phase>" (phase: what the main thread is doing,
               e.g. "step 12 forward/backward"; set by the trainer)
    watches    reads the beats of the next WATCHED ranks (a ring, so every rank is watched by two and
               the store answers O(world) requests a second, not O(world^2)); a counter that has not
               moved for ``timeout_s`` by this rank's own clock (clocks of nodes need not agree)
               means that rank is dead: the watcher writes the verdict
    listens    reads ``verdict``: the first failure anyone wrote (compare_set: later ones keep it)

Once there is a verdict, every rank prints it as one line (``error: rank 2 (host h, local rank 0),
rank 3 (host h, local rank 1) stopped beating 15 s ago (dead?), last in step 12``: every silent rank,
since torchrun stops a node's other workers when one dies) and ends its process with
os._exit(EXIT_PEER_FAILED): the main thread may be inside a collective that only the timeout would
end. torchrun sees the non-zero exit and stops that node's other workers; every node's ranks get the
verdict from the store, so every node stops within timeout_s + a few intervals.

A rank that raises writes its own verdict ("rank 2 raised ...") before it exits, and the others stop
at once. When its error is a communication error (a gloo peer vanished: connection reset), it may be
the symptom of another rank's death: ``failed`` then first waits up to timeout_s for a verdict that
names the cause. A rank that finishes marks its beat "done", after which silence is not death.

The store is torchrun's (the agent on node 0 hosts it, so it outlives any worker), reached through
its own client connection from the thread; a store that stops answering for timeout_s is itself a
verdict (node 0 is gone).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

from mpformer.core.errors import ConfigError

INTERVAL_S = 1.0
WATCHED = 2
EXIT_PEER_FAILED = 4
_COMM_ERRORS = ("gloo", "nccl", "connection", "socket", "peer", "timed out", "broken pipe")


def _describe(rank: int) -> str:
    return f"rank {rank} (host {socket.gethostname()}, local rank {os.environ.get('LOCAL_RANK', '?')})"


class Heartbeat:
    def __init__(self, rank: int, world_size: int, timeout_s: float, host: str, port: int) -> None:
        self.rank, self.world, self.timeout_s = rank, world_size, timeout_s
        attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=max(timeout_s, 5.0)))
        self.store = dist.PrefixStore(f"mpformer/heartbeat/{attempt}/", client)
        self.phase = "start-up"
        self.done = False
        self._stop, self._wake = threading.Event(), threading.Event()
        self.store.set(f"who/{rank}", _describe(rank))
        self._beat(0)
        self.watched = [(rank + i) % world_size for i in range(1, min(WATCHED, world_size - 1) + 1)]
        self._thread = threading.Thread(target=self._run, name="mpformer-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, timeout_s: float) -> Heartbeat | None:
        """The heartbeat of a torchrun worker (None: one process, or timeout_s=0)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if timeout_s <= 0 or world < 2 or "MASTER_ADDR" not in os.environ:
            return None
        return cls(int(os.environ["RANK"]), world, timeout_s, os.environ["MASTER_ADDR"],
                   int(os.environ["MASTER_PORT"]))

    # ---- the main thread's side ------------------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        """What the main thread does now (named in the verdict if this rank dies in it): beaten at once."""
        self.phase = phase
        self._wake.set()

    def finish(self) -> None:
        """This rank ends normally: its silence from now on is not death."""
        self.done = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5 * INTERVAL_S)
        self._beat(-1)

    def failed(self, error: BaseException) -> None:
        """This rank is about to exit with ``error``. A communication error waits for the cause to be
        named (another rank's death, the verdict exits this process); anything else is the verdict."""
        text = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        if isinstance(error, ConfigError):
            # Often every rank finds the same mistake at once (a damaged checkpoint, a failed save) and
            # stops by itself; only a rank-local one (a bad token in this rank's batch) needs telling.
            time.sleep(2.0)
        elif any(w in text.lower() for w in _COMM_ERRORS):
            deadline = time.monotonic() + self.timeout_s + 3 * INTERVAL_S
            while time.monotonic() < deadline:
                if self._verdict() is not None:
                    time.sleep(5 * INTERVAL_S)  # the thread prints it and exits the process
                time.sleep(INTERVAL_S / 4)
        self._decide(f"{_describe(self.rank)} raised {text}, in {self.phase}")
        self._stop.set()
        self._wake.set()

    # ---- the thread ------------------------------------------------------------------------------
    def _beat(self, counter: int) -> None:
        value = "done" if self.done else f"{counter} {self.phase}"
        self.store.set(f"beat/{self.rank}", value)

    def _verdict(self) -> str | None:
        return self.store.get("verdict").decode() if self.store.check(["verdict"]) else None

    def _decide(self, verdict: str) -> None:
        try:
            self.store.compare_set("verdict", "", verdict)  # the first verdict stays
        except Exception:  # the store may be gone with node 0; this rank exits anyway
            pass

    def _run(self) -> None:
        last: dict[int, tuple[str, float]] = {}
        counter, store_ok, watched_at = 0, time.monotonic(), 0.0
        while True:
            self._wake.wait(INTERVAL_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            counter += 1
            try:
                self._beat(counter)
                verdict = None
                if time.monotonic() - watched_at >= INTERVAL_S:  # a phase change beats early, not watches
                    watched_at = time.monotonic()
                    verdict = self._verdict() or self._watch(last)
                store_ok = time.monotonic()
            except Exception as e:  # a store that stops answering is itself the news
                if time.monotonic() - store_ok < self.timeout_s:
                    continue
                verdict = f"the rendezvous store stopped answering ({type(e).__name__}: {e}); node 0 is gone"
            if verdict is not None and not self._stop.is_set():
                self._exit(verdict)

    def _watch(self, last: dict[int, tuple[str, float]]) -> str | None:
        keys = [f"beat/{r}" for r in self.watched]
        if not self.store.check(keys):  # a peer still starting up: not watched yet
            return None
        now = time.monotonic()
        for r, raw in zip(self.watched, self.store.multi_get(keys)):
            value = raw.decode()
            if value == "done":
                continue
            seen, since = last.get(r, (None, now))
            if value != seen:
                last[r] = (value, now)
            elif now - since > self.timeout_s:
                phase = value.partition(" ")[2] or "?"
                dead = ", ".join(self.store.get(f"who/{d}").decode() for d in self._silent())
                verdict = f"{dead} stopped beating {now - since:.0f} s ago (dead?), last in {phase}"
                self._decide(verdict)
                return self._verdict() or verdict
        return None

    def _silent(self) -> list[int]:
        """Every rank whose beat does not move over two intervals: a launcher stops the other workers of a
        node when one dies, so the dead one is named beside its node-mates, not instead of them."""
        keys = [f"beat/{r}" for r in range(self.world)]
        before = self.store.multi_get(keys)
        time.sleep(2 * INTERVAL_S)
        after = self.store.multi_get(keys)
        return [r for r, (a, b) in enumerate(zip(before, after)) if a == b and b != b"done" and r != self.rank]

    def _exit(self, verdict: str) -> None:
        print(f"error: {verdict}; rank {self.rank} exits (train.heartbeat_timeout_s={self.timeout_s:g})",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_PEER_FAILED)
