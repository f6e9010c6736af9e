"""Per-container ordering of the isolator's calls, and the error every call leaves with.

Rules:
- Calls for one container apply in arrival order: each goes through that
  container's ``runtime.Sequence`` (``usage`` too, while a call on it is in
  flight); calls for different containers run concurrently. A call on an
  idle container runs as the current event (no Sequence, no Future, no hop:
  the container is marked running); a Sequence is made only when a call
  must wait behind another (``Sequence.claim`` for the running one), and is
  dropped once idle.
- Every call also waits for a recovery issued before it (``_recovering``).
- Every failure leaves as an ``IsolatorError`` with the original text and
  cause (``as_isolator_error``). A ``SimulatedCrash`` from device control
  (fault injection) fails the call and every later call: the agent is
  "dead"; drop every actor and recover.
- Mixed into the isolator actor (``NvidiaGpuIsolatorProcess``).
"""

from __future__ import annotations

from typing import Any

from actors.devices.testing import SimulatedCrash
from runtime import Future, Sequence, await_all, dispatch

from ._errors import IsolatorError, as_isolator_error
from ._types import ContainerID


class ContainerOrdering:
    """The isolator actor's per-container ordering (see the module rules)."""

    pid: Any
    _recovering: Future | None

    def _init_ordering(self) -> None:
        self._sequences: dict[ContainerID, Sequence] = {}
        """Per container whose calls overlap: its calls in arrival order (dropped when idle)."""
        self._running: set[ContainerID] = set()
        """Containers with a call running as the event that issued it (no Sequence
        until another call must wait behind it)."""
        self._crashed: SimulatedCrash | None = None

    def _release_all(self) -> None:
        """At finalize: a claimed call that never started (trio: terminated
        before its task ran) must not hold what waits behind it: those now
        fail with ProcessTerminated, as every queued event does."""
        for sequence in list(self._sequences.values()):
            sequence.release()

    def _in_order(self, container_id: ContainerID, operation: Any, *args: Any) -> Any:
        """Run ``operation(*args)`` on this actor after every earlier call on
        this container (its Sequence), and after a recovery issued before it.
        When nothing is in flight, the call runs as the current event (no
        Sequence, no Future, no hop: the container is marked running);
        otherwise it is dispatched in its turn."""
        recovery = self._recovering
        sequence = self._sequences.get(container_id)
        if sequence is None:
            if recovery is None and container_id not in self._running:
                self._running.add(container_id)
                return self._run(container_id, operation, args, True)
            sequence = self._sequence(container_id)
        return sequence.add(dispatch, self.pid, type(self)._run, container_id, operation, args, False,
                            recovery)

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

    def _in_flight(self, container_id: ContainerID) -> bool:
        """Whether a call on this container is running or waiting."""
        return container_id in self._running or container_id in self._sequences

    def _forgetter(self, container_id: ContainerID) -> Any:
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
                raise SimulatedCrash(f"the agent crashed earlier ({self._crashed})")
            return await operation(*args)
        except SimulatedCrash as crash:
            # Fault injection: the agent "died" in this call. Fail it as an
            # Exception (a BaseException would never complete its Future)
            # and refuse every later call; drop every actor and recover.
            while isinstance(crash.__context__, SimulatedCrash):  # an undo hit the dead backend
                crash = crash.__context__
            self._crashed = self._crashed or crash
            who = f"Container {container_id}" if container_id is not None else "Recovery"
            raise IsolatorError(f"{who}: simulated crash of the agent: {crash}; drop every actor and recover") from crash
        except IsolatorError:
            raise
        except Exception as error:
            raise as_isolator_error(error) from error
        finally:
            if claimed:
                self._release(container_id)  # type: ignore[arg-type]
