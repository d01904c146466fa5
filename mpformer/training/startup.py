"""SIGTERM during start-up: the run ends at once, in one line, with nothing saved.

From the CLI's first check until this process's first step has finished (the index
build, the checkpoint load, the process groups, compile and the first step that triggers it) there
is nothing to save: ``StartupStop`` ends the process at once on SIGTERM, one line on stderr and exit
STARTUP_EXIT (143, as a death by SIGTERM reports), no checkpoint. It does not wait for the main
thread to come back to Python (it may sit minutes inside one C call that releases the GIL: a
collective waiting for a rank that is gone, a large read, a kernel): the signal's wakeup byte reaches
a thread that exits, as the heartbeat's verdict does (parallel/watchdog.py). (A C loop that holds the
GIL delays every thread, this one too, until it returns.) Every rank gets the signal (torchrun forwards
it; mpformer's test spawner kills the others once one rank exits), and a rank that misses it finds
its peers gone through the heartbeat.

Pure Python (no torch): the CLI installs it before its first check, while bad input still fails in
well under a second.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

STARTUP_EXIT = 128 + signal.SIGTERM  # the status a shell or scheduler sees for a death by SIGTERM


class StartupStop:
    """SIGTERM before the first step has finished: one line, exit STARTUP_EXIT at once (nothing to save).
    ``install`` from the main thread (elsewhere it does nothing: signal handlers live there); ``end``
    gives the previous handler back, after which Preemption takes SIGTERM over."""

    def __init__(self) -> None:
        self._previous: object = None
        self._wakeup: tuple[int, int] | None = None  # the pipe the signal's byte goes into
        self._previous_fd = -1
        self._stopping = threading.Lock()  # the watcher and the handler may both get there: one line

    def install(self) -> StartupStop:
        if threading.current_thread() is not threading.main_thread() or self._wakeup is not None:
            return self
        self._wakeup = os.pipe()
        os.set_blocking(self._wakeup[1], False)  # set_wakeup_fd's requirement
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        self._previous_fd = signal.set_wakeup_fd(self._wakeup[1])
        threading.Thread(target=self._watch, args=(self._wakeup[0],), name="mpformer-startup-sigterm",
                         daemon=True).start()
        return self

    def end(self) -> None:
        if self._wakeup is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        # None: a handler not set from Python, which cannot be put back; the default is what was there
        signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
        write = self._wakeup[1]
        self._wakeup = None
        os.close(write)  # the watcher reads end-of-file and returns (it closes its end)

    def _watch(self, fd: int) -> None:
        while chunk := os.read(fd, 64):  # one byte per signal that has a Python handler
            if signal.SIGTERM in chunk:
                self._stop()
        os.close(fd)

    def _on_signal(self, signum: int, frame) -> None:  # the main thread, when it gets back to Python first
        self._stop()

    def _stop(self) -> None:
        if not self._stopping.acquire(blocking=False):
            return  # the other one is writing the line and ending the process
        world = int(os.environ.get("WORLD_SIZE", "1"))
        who = f"rank {os.environ.get('RANK', '?')}: " if world > 1 else ""
        line = (f"{who}SIGTERM during start-up (before the first training step finished): stopped at once, "
                "nothing to save\n")
        for stream in (sys.stdout, sys.stderr):  # what was printed before it, then the line
            try:
                stream.flush()
            except Exception:  # a write the signal interrupted: the line still goes out below
                pass
        os.write(2, line.encode())
        os._exit(STARTUP_EXIT)
