"""The in-memory backend's shared tables, through their public calls: what a
restarted agent recovers from, what tests change to fake drift and drop at
teardown (R-DV-3)."""

from __future__ import annotations

import uuid

from actors.devices import Policy, DeviceRule, MemoryBackend, container_policy

ALLOW, DENY = container_policy([DeviceRule.parse("c 195:255 rwm")], [DeviceRule.parse("c 195:0 rwm")])


def fresh_root() -> str:
    return f"memory:/gpu-isolator-test-shared-{uuid.uuid4().hex[:8]}"


def test_a_shared_table_is_the_backends_live_state_and_outlives_it() -> None:
    root = fresh_root()
    assert MemoryBackend.shared_table(root) is None and root not in MemoryBackend.shared_roots()
    backend = MemoryBackend(root, shared=True)
    access = backend.configure("parent/c1", ALLOW, DENY)
    table = MemoryBackend.shared_table(root)
    assert table == {"parent/c1": access} and root in MemoryBackend.shared_roots()
    # drift faked from outside is what the backend (and a restarted one) sees
    table["parent/c1"] = Policy.create(["a *:* rwm"], [])
    restarted = MemoryBackend(root, shared=True)
    assert restarted.state("parent/c1") == Policy.create(["a *:* rwm"], [])
    assert restarted.reconcile("parent/c1", access) == [f"{root}/parent/c1: restored the device policy"]
    assert backend.state("parent/c1") == access
    assert restarted.remove("parent/c1") and restarted.remove_root()
    assert MemoryBackend.shared_table(root) is None and root not in MemoryBackend.shared_roots()


def test_dropping_a_table_forgets_its_cgroups_and_their_parents() -> None:
    root = fresh_root()
    backend = MemoryBackend(root, shared=True)
    backend.configure("parent/c1", ALLOW, DENY)
    assert not backend.remove("parent")  # a child is left: kept
    MemoryBackend.drop_shared(root)
    assert MemoryBackend.shared_table(root) is None
    again = MemoryBackend(root, shared=True)  # a new table: no cgroup, no stale child count
    assert again.list_cgroups() == [] and again.remove("parent")
    again.configure("parent", ALLOW, DENY)
    assert again.remove("parent") and again.remove_root()
    MemoryBackend.drop_shared(root)  # dropping what is gone is nothing
    assert MemoryBackend.shared_table(root) is None


def test_a_private_backend_shares_nothing() -> None:
    root = fresh_root()
    MemoryBackend(root).configure("c1", ALLOW, DENY)
    assert MemoryBackend.shared_table(root) is None
