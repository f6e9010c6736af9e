"""Ordering: the isolator's calls in their order, and the error every call leaves with.

Rules:
- Calls for one container apply in arrival order: each goes through that
  container's ``runtime.Sequence`` (``usage`` too, while a call on it is in
  flight); calls for different containers run concurrently. A call on an
  idle container runs as the current event (no Sequence, no Future, no hop:
  the container is marked running); a Sequence is made only when a call
  must wait behind another (``Sequence.claim`` for the running one), and is
  dropped once idle.
- A recovery (``recover``) runs one at a time (a Sequence of recoveries),
  once every call issued before it is done (a no-op added to each busy
  container's Sequence); while it runs or waits, every call issued after it
  waits for it (``quiet`` is False meanwhile).
- Every failure leaves as an ``IsolatorError`` with the original text and
  cause (``as_isolator_error``). An ``AgentCrash`` from device control
  (fault injection's simulated crash) fails the call and every later call:
  the agent is "dead"; drop every actor and recover.
- A part the isolator actor owns (as libprocess' ``Sequence`` owns its
  process): bound to the actor's pid at initialize, its queued calls run
  as the actor's events; ``close()`` at finalize.
"""

from __future__ import annotations

from typing import Any, Callable

from actors.devices import AgentCrash
from runtime import PID, Future, Sequence, await_all, dispatch

from ._errors import IsolatorError, as_isolator_error
from ._types import ContainerID

__all__ = ["Ordering"]


def _nothing() -> None:
    """A no-op in a container's sequence: done once the calls before it are."""


def _turn(_process: Any, ordering: "Ordering", container_id: ContainerID | None, operation: Any, args: tuple,
          recovery: Future | None) -> Any:
    """A queued call, run as an event of the actor that owns ``ordering``."""
    return ordering._run(container_id, operation, args, False, recovery)


class Ordering:
    """The order of an isolator's calls (see the module rules)."""

    __slots__ = ("_pid", "_sequences", "_running", "_recoveries", "_recovering", "_crashed")

    def __init__(self) -> None:
        self._pid: PID | None = None
        self._sequences: dict[ContainerID, Sequence] = {}
        """Per container whose calls overlap: its calls in arrival order (dropped when idle)."""
        self._running: set[ContainerID] = set()
        """Containers with a call running as the event that issued it (no Sequence
        until another call must wait behind it)."""
        self._recoveries = Sequence(on_idle=self._recovered)
        """Recoveries, one at a time."""
        self._recovering: Future | None = None
        """The last recovery issued, while it runs or waits: later calls wait for it."""
        self._crashed: AgentCrash | None = None

    def bind(self, pid: PID) -> None:
        """The actor that runs the calls (at its initialize)."""
        self._pid = pid

    # -- what is in flight -----------------------------------------------------------
    def quiet(self, container_id: ContainerID) -> bool:
        """Whether nothing is in flight on this container, no recovery runs or
        waits and the agent has not crashed: a call on it may be answered at once."""
        return (self._recovering is None and self._crashed is None and container_id not in self._running
                and container_id not in self._sequences)

    def sequences(self) -> int:
        """Containers that have a Sequence now (none once every call is done)."""
        return len(self._sequences)

    # -- calls -------------------------------------------------------------------
    def call(self, container_id: ContainerID, operation: Callable[..., Any], *args: Any) -> Any:
        """Run ``operation(*args)`` after every earlier call on this container
        (its Sequence), and after a recovery issued before it. When nothing is
        in flight, the call runs as the current event (no Sequence, no Future,
        no hop: the container is marked running); otherwise it is dispatched
        in its turn."""
        recovery = self._recovering
        sequence = self._sequences.get(container_id)
        if sequence is None:
            if recovery is None and container_id not in self._running:
                self._running.add(container_id)
                return self._run(container_id, operation, args, True)
            sequence = self._sequence(container_id)
        return sequence.add(dispatch, self._pid, _turn, self, container_id, operation, args, recovery)

    def recover(self, operation: Callable[..., Any], *args: Any) -> Future:
        """Run ``operation(*args, earlier)`` once every earlier recovery is done;
        ``earlier`` are Futures of every call issued before it (await them).
        Every call issued from now on waits for it."""
        busy = [cid for cid, sequence in self._sequences.items() if not sequence.is_idle()]
        busy += [cid for cid in self._running if cid not in self._sequences]
        earlier = [self._sequence(cid).add(_nothing) for cid in busy]
        recovery = self._recoveries.add(dispatch, self._pid, _turn, self, None, operation, (*args, earlier), None)
        self._recovering = recovery
        return recovery

    def close(self) -> None:
        """At finalize: a claimed call that never started (trio: terminated
        before its task ran) must not hold what waits behind it: those now
        fail with ProcessTerminated, as every queued event does."""
        for sequence in list(self._sequences.values()):
            sequence.release()

    # -- inside -------------------------------------------------------------------
    def _recovered(self) -> None:
        self._recovering = None  # no recovery running or waiting

    def _sequence(self, container_id: ContainerID) -> Sequence:
        """The container's Sequence, made when a call must wait: a call running
        as the event that issued it holds it (``Sequence.claim``) until it
        ends. Dropped once idle."""
        sequence = self._sequences.get(container_id)
        if sequence is None:
            sequence = self._sequences[container_id] = Sequence(on_idle=self._forgetter(container_id))
            if container_id in self._running:
                sequence.claim()
        return sequence

    def _forgetter(self, container_id: ContainerID) -> Callable[[], None]:
        def forget() -> None:
            sequence = self._sequences.get(container_id)
            if sequence is not None and sequence.is_idle():
                del self._sequences[container_id]
        return forget

    def _release(self, container_id: ContainerID) -> None:
        """A call that ran as its own event ended: the container's next call may start."""
        self._running.discard(container_id)
        sequence = self._sequences.get(container_id)
        if sequence is not None:
            sequence.release()

    async def _run(self, container_id: ContainerID | None, operation: Any, args: tuple,
                   claimed: bool = False, recovery: Future | None = None) -> Any:
        """Run one verb (once ``recovery``, issued before it, is done): every
        failure leaves as an ``IsolatorError`` with the original text and
        cause (see ``as_isolator_error``)."""
        try:
            if recovery is not None and recovery.is_pending():
                await await_all([recovery])  # its outcome is its caller's; this call goes on either way
            if self._crashed is not None:
                raise type(self._crashed)(f"the agent crashed earlier ({self._crashed})")
            return await operation(*args)
        except AgentCrash as crash:
            # The agent "died" in this call. Fail it as an Exception (a
            # BaseException would never complete its Future) and refuse every
            # later call; drop every actor and recover.
            while isinstance(crash.__context__, AgentCrash):  # an undo hit the dead backend
                crash = crash.__context__
            self._crashed = self._crashed or crash
            who = f"Container {container_id}" if container_id is not None else "Recovery"
            raise IsolatorError(f"{who}: {crash.kind} of the agent: {crash}; drop every actor and recover") from crash
        except IsolatorError:
            raise
        except Exception as error:
            raise as_isolator_error(error) from error
        finally:
            if claimed:
                self._release(container_id)  # type: ignore[arg-type]
