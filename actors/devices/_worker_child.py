"""The device worker process itself: the child's entry point.

The agent (``_worker``) starts it as ``python -I -S -c BOOT SPEC PATH...``;
``BOOT`` asks for the parent-death signal first of all, puts ``PATH...`` in
front of ``sys.path`` and calls ``main(SPEC)``.
Importing this module imports the device backend modules it needs and
nothing of the agent (the ``actors`` packages load their names lazily).

Rules:
- It dies with its agent. First thing (in ``BOOT``, before any import),
  it asks the kernel for SIGKILL when its parent goes
  (``PR_SET_PDEATHSIG``); ``main`` asks again, checking the answer, and
  then checks that its parent is still the agent that started it (one that
  died before that call is not noticed by the kernel). Before each
  operation it checks again: once the agent is gone it exits at once,
  applying nothing more (fenced). A worker stopped before it got that far
  is fenced all the same: when it runs again its first check exits.
- It keeps the agent's work-directory lock open for its whole life (it
  inherited the descriptor): a new agent cannot take the lock, and so
  cannot start, while this process can still touch the kernel.
- It builds the one backend (v1 or v2), answers ``ready`` or the error that
  building raised (a bad hierarchy) and then applies batches in the order
  they come, one operation at a time, each through the same function as
  every driver in the agent (``_backend.applier``): one value or exception
  per operation; results go back at least every ``SLICE`` seconds. See
  ``_frames`` for the frames.
- Log records are collected and go back with the results.
- Between batches it polls its pipe for ``POLL`` seconds (a read that does
  not wait, the CPU yielded between reads) before it sleeps in ``poll(2)``:
  an agent running one container at a time sends the next batch within
  tens of µs, and waking a sleeping worker costs more than the batch
  itself (measured on these machines: ~27 µs in the ``write(2)`` that
  wakes an idle CPU, and ~100 µs a round trip, against ~30 µs with the
  worker polling). Any other task wanting its CPU gets it.
- It exits when the agent closes its end of the pipe (or stops reading).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import sys
import time
from typing import Any

from ._backend import applier
from ._errors import DeviceControlError
from ._frames import READ_SIZE, FrameReader, unwire, wire, write_frame

SLICE = 0.0005
"""Seconds between result frames while the backend works through a batch."""

POLL = 0.0005
"""Seconds the worker polls for its next batch after answering one, before
it sleeps in a read (see the module rules)."""

PR_SET_PDEATHSIG = 1
FENCED_EXIT = 3
"""Exit status of a worker that found its agent gone."""

BOOT = (
    "import ctypes, sys; ctypes.CDLL(None).prctl(1, 9, 0, 0, 0); "  # PR_SET_PDEATHSIG, SIGKILL: before any import
    "sys.path[:0] = sys.argv[2:]; from actors.devices._worker_child import main; main(sys.argv[1])"
)


class _Collect(logging.Handler):
    """Keeps the records logged while a batch is applied."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append((record.name, record.levelno, record.getMessage()))
        except Exception:  # a record that cannot be formatted is not worth the batch
            pass

    def take(self) -> list[tuple[str, int, str]]:
        records, self.records = self.records, []
        return records


def die_with_parent(parent: int) -> None:
    """SIGKILL when the parent goes; exit now if it has already gone."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(error)}")
    check_parent(parent)


def check_parent(parent: int) -> None:
    """Exit at once (fenced) unless the process that started us is still our parent."""
    if os.getppid() != parent:
        os._exit(FENCED_EXIT)


def build_backend(spec: dict[str, Any]) -> Any:
    kind = spec["kind"]
    if kind == "cgroups_v1":
        from ._cgroups_v1 import CgroupsV1Backend

        return CgroupsV1Backend(spec["hierarchy"], spec["cgroups_root"])
    if kind == "cgroups_v2":
        from ._cgroups_v2 import CgroupsV2Backend

        return CgroupsV2Backend(spec["hierarchy"], spec["cgroups_root"])
    raise DeviceControlError(f"A device worker runs cgroups_v1 or cgroups_v2, not {kind!r}")


def main(argument: str) -> None:
    """Entry point (see module rules)."""
    spec = json.loads(argument)
    parent = spec["parent"]
    die_with_parent(parent)
    read_fd, write_fd = spec["fds"]
    collect = _Collect()
    root = logging.getLogger()
    root.handlers[:] = [collect]
    root.setLevel(spec["log_level"])
    try:
        backend = build_backend(spec)
    except Exception as error:
        write_frame(write_fd, ("error", error, collect.take()))
        return
    try:
        write_frame(write_fd, ("ready", (backend.name, backend.root), collect.take()))
        serve(backend, read_fd, write_fd, parent, collect)
    except BrokenPipeError:
        pass  # the agent stopped reading: it went away or closed us
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()


def _reader(read_fd: int, poll_s: float) -> Any:
    """``read()``: the agent's next bytes (b"" at its end); for ``poll_s`` the
    pipe is polled, the CPU yielded between polls, before a read that sleeps."""
    os.set_blocking(read_fd, False)
    waiter = select.poll()
    waiter.register(read_fd, select.POLLIN)
    clock, read, pause = time.perf_counter, os.read, os.sched_yield

    def next_bytes() -> bytes:
        deadline = 0.0
        while True:
            try:
                return read(read_fd, READ_SIZE)
            except BlockingIOError:
                pass
            now = clock()
            if not deadline:
                deadline = now + poll_s
            elif now >= deadline:
                waiter.poll()  # sleep until the agent writes (or closes its end)
                deadline = 0.0
                continue
            pause()

    return next_bytes


def serve(backend: Any, read_fd: int, write_fd: int, parent: int, collect: _Collect, poll_s: float = POLL) -> None:
    """Apply batches until the agent closes its end (see module rules)."""
    frames = FrameReader()
    apply = applier(backend)
    clock = time.perf_counter
    next_bytes = _reader(read_fd, poll_s)
    while True:
        frame = frames.next()
        if frame is None:
            data = next_bytes()
            if not data:
                return  # the agent closed its end
            frames.feed(data)
            continue
        results = []
        sent = clock()
        last = len(frame) - 1
        for index, (kind, args) in enumerate(frame):
            check_parent(parent)  # fenced: nothing more once the agent is gone
            results.append(apply(kind, unwire(args)))
            if index == last or clock() - sent >= SLICE:
                write_frame(write_fd, ("done" if index == last else "part", wire(results), collect.take()))
                results = []
                sent = clock()


if __name__ == "__main__":  # pragma: no cover - started through BOOT
    main(sys.argv[1])
