"""Actor frameworks side by side: the runtime against the Queue actor and the peers users would pick.

Rules of the measurement:
- Contenders (``lineup``): the runtime (``ours``); a hand-written
  ``asyncio.Queue`` actor (``queue_actor``, the floor a user could write
  in ten lines); and every peer framework installed: pykka
  (``ThreadingActor``), xoscar (an actor pool in this process), thespian
  (``simpleSystemBase``), compactor (PyPI's libprocess port). The
  ``[bench]`` extra installs them; one that is missing is reported and
  skipped. Reported, not held to a bar: the runtime's ``dispatch`` used
  as a tell (its Future dropped) and xoscar's ``LocalActorRef`` (a direct
  call in the caller's coroutine, no message hop).
- Workloads (``contender``): sequential round trips; ``--callers`` (100)
  concurrent callers; fan-out (spawn ``--actors`` (1000) actors, call each
  once, stop all); tells (``--tells`` fire-and-forget messages to one
  actor, then one call to sync; every tell must have arrived).
- All in one process and one asyncio loop, interleaved round robin
  (``measure``): every round runs each workload for every contender,
  rotated, so a burst of load on a shared machine hits all alike.
  Figures are medians of ``--repeat`` (5) rounds: operations per second,
  the runtime's ratio (runtime ÷ contender: above 1.0 the runtime is
  faster) and CPU µs per operation. Then peak RSS per live actor
  (``memory``: ``--memory-actors`` (2000) actors, each contender in a
  child process of its own; 0 skips it).
- The bars the runtime is held to (``measure.bars``) are printed with
  their verdicts; ``--quick`` is a smaller run for a quick look.
- Output (``report``): a table, then one JSON line (``--json-only``: only
  the JSON line), both with the machine's load average.

Run: ``python -m benchmarks.peers [--quick] [--only pykka,xoscar]``
(``run.main``).
"""

from .run import main

__all__ = ["main"]
