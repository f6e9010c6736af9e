"""In-memory device backend: the rule model with no kernel (SPEC R-DV-3).

Rules:
- The same semantics as the kernel backends, kept in a dict
  ``cgroup -> Policy``; for non-root use and the demo.
- Its pretend kernel operations (``mkdir``, ``apply``, ``rmdir``) go
  through the kernel seam like the kernel backends' syscalls (``_kernel``:
  one path; faults are injected there): a new cgroup is made, then its
  policy applied, as the kernel backends do.
- Processes never live in a memory cgroup, so ``remove`` always succeeds.
- ``reconcile`` has nothing to drift from: it stores ``desired`` when the
  record differs and says so.
- ``remove`` finds child cgroups by a count kept per parent (O(depth), not
  a scan of every cgroup: churn keeps thousands).
- ``shared=True`` (what ``DeviceControl.create`` uses) keeps the cgroups in a
  per-root table of this OS process that outlives the backend, as the kernel
  outlives an agent: a restarted isolator recovers from it.
  ``remove_root`` drops that table once it is empty. ``shared_table(root)``
  is that table, live (tests change it to fake drift: a reload, a lost
  cgroup); ``shared_roots()`` lists the tables; ``drop_shared(root)``
  forgets one whatever it holds (as removing a cgroup tree from a kernel).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from ._backend import BackendBase, validate_cgroup, validate_confined
from ._errors import DeviceControlError
from ._policy import Policy, apply_diff, as_policy
from ._rules import DeviceRule, check_diff

logger = logging.getLogger(__name__)


_PRETEND_KERNEL: dict[str, dict[str, Policy]] = {}
"""Shared in-memory cgroups by root (see ``shared``)."""

_PRETEND_CHILDREN: dict[str, dict[str, int]] = {}
"""How many cgroups lie below each parent cgroup, by root (kept with the table)."""

_MADE = Policy()
"""What a cgroup holds between its mkdir and its rules (nothing restricts it)."""


class MemoryBackend(BackendBase):
    """Device rules kept in memory (see module rules)."""

    name = "memory"
    blocking = False

    def __init__(self, root: str = "memory:/gpu-isolator", shared: bool = False) -> None:
        super().__init__(root)
        self._prefix = root.rstrip("/") + "/"
        self._shared = shared
        self._cgroups: dict[str, Policy] = _PRETEND_KERNEL.setdefault(root, {}) if shared else {}
        self._children: dict[str, int] = _PRETEND_CHILDREN.setdefault(root, {}) if shared else {}
        self.confined: dict[str, Policy] = {}
        """Cgroups outside the root given to ``confine``, with their policy."""
        if not self._children:
            for cgroup in self._cgroups:
                self._count(cgroup, 1)

    @staticmethod
    def shared_table(root: str) -> dict[str, Policy] | None:
        """The live shared table of ``root`` (cgroup -> access), None when there is none."""
        return _PRETEND_KERNEL.get(root)

    @staticmethod
    def shared_roots() -> list[str]:
        """The roots that have a shared table in this OS process."""
        return sorted(_PRETEND_KERNEL)

    @staticmethod
    def drop_shared(root: str) -> None:
        """Forget the shared table of ``root`` and every cgroup in it."""
        _PRETEND_KERNEL.pop(root, None)
        _PRETEND_CHILDREN.pop(root, None)

    def remove_root(self) -> bool:
        if self._cgroups:
            return False
        if self._shared:
            _PRETEND_KERNEL.pop(self.root, None)
            _PRETEND_CHILDREN.pop(self.root, None)
        return True

    def _set(self, cgroup: str, access: Policy) -> None:
        if cgroup not in self._cgroups:
            self._count(cgroup, 1)
        self._cgroups[cgroup] = access

    def _drop(self, cgroup: str) -> None:
        if self._cgroups.pop(cgroup, None) is not None:
            self._count(cgroup, -1)

    def _count(self, cgroup: str, delta: int) -> None:
        """Add ``delta`` to the count of cgroups below each parent of ``cgroup``."""
        if "/" not in cgroup:
            return
        parts = cgroup.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            left = self._children.get(parent, 0) + delta
            if left > 0:
                self._children[parent] = left
            else:
                self._children.pop(parent, None)

    def _has_children(self, cgroup: str) -> bool:
        # The count, confirmed: a table changed from outside (tests fake drift
        # that way) must not keep a cgroup that has no child left.
        return bool(self._children.get(cgroup)) and any(
            other.startswith(cgroup + "/") for other in self._cgroups
        )

    def _pretend(self, op: str, cgroup: str, fn: Any, *args: Any) -> None:
        """One pretend kernel operation on (validated) ``cgroup``, through the kernel seam."""
        self.kernel.run(op, self._prefix + cgroup, fn, *args)

    def configure(
        self, cgroup: str, allow: Policy | Iterable[DeviceRule], deny: Iterable[DeviceRule] = ()
    ) -> Policy:
        validate_cgroup(cgroup)
        access = as_policy(allow, deny)
        cgroups = self._cgroups
        run = self.kernel.run
        target = self._prefix + cgroup
        if cgroup not in cgroups:
            run("mkdir", target, cgroups.__setitem__, cgroup, _MADE)
            if "/" in cgroup:
                self._count(cgroup, 1)
            try:
                run("apply", target, cgroups.__setitem__, cgroup, access)
            except Exception:
                self._drop(cgroup)
                raise
        else:
            run("apply", target, cgroups.__setitem__, cgroup, access)
        return access

    def reconfigure(self, cgroup: str, add: Iterable[DeviceRule], remove: Iterable[DeviceRule]) -> Policy:
        validate_cgroup(cgroup)
        add, remove = check_diff(add, remove)
        current = self._cgroups.get(cgroup)
        if current is None:
            raise DeviceControlError(f"Cannot reconfigure cgroup '{cgroup}': it is not configured")
        access = apply_diff(current, add, remove)
        self._pretend("apply", cgroup, self._set, cgroup, access)
        return access

    def remove(self, cgroup: str) -> bool:
        validate_cgroup(cgroup)
        if self._has_children(cgroup):
            logger.warning("Cgroup %s still has child cgroups; keeping it", self.path(cgroup))
            return False
        if cgroup in self._cgroups:
            self._pretend("rmdir", cgroup, self._drop, cgroup)
        return True

    def state(self, cgroup: str) -> Policy | None:
        return self._cgroups.get(validate_cgroup(cgroup))

    def exists(self, cgroup: str) -> bool:
        return validate_cgroup(cgroup) in self._cgroups

    def list_cgroups(self) -> list[str]:
        return sorted(self._cgroups)

    def confine(self, path: str, access: Policy) -> list[str]:
        """Recorded (``confined``); nothing to enforce in memory."""
        path = validate_confined(path, self.root, self.root.partition(":")[2].strip("/"))
        if self.confined.get(path) == access:
            return []
        self.confined[path] = access
        return [f"memory:/{path}: confined"]

    def reconcile(self, cgroup: str, desired: Policy) -> list[str]:
        validate_cgroup(cgroup)
        current = self._cgroups.get(cgroup)
        if current == desired:
            return []
        self._pretend("apply", cgroup, self._set, cgroup, desired)
        if current is None:
            return [f"{self.path(cgroup)}: recreated the missing cgroup with its device policy"]
        return [f"{self.path(cgroup)}: restored the device policy"]
