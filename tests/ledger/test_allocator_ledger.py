"""SPEC 22 (R-NL-1..3, R-NL-5): the allocator actor is the one place that takes
and returns node ledger leases -- two owners never hold one unit, a refusal
names unit, owner and holder, a dead owner's units wait for it, churn costs
no file work."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from actors import Gpu, NvidiaGpuAllocator
from actors.allocator import LINGER, AllocatorError, LedgerState
from actors.flags import Flags
from actors.ledger import LedgerDirectory, LedgerError, isolator_owner, serve_owner
from actors.mig import MigDevice
from runtime import Clock, ProcessTerminated, Runtime, current_runtime, terminate, wait
from tests.support.ledger import BOUND, inode_limited, leases, owner_free, until

DATA = Path(__file__).resolve().parents[1] / "inventory" / "data"
A = isolator_owner("/var/lib/agent-a")
B = serve_owner("/run/gpu-isolator/gpu-isolator.sock")
G = [Gpu(195, minor) for minor in range(4)]


@pytest.fixture
def host_file(tmp_path: Path) -> Path:
    path = tmp_path / "node.toml"
    path.write_text('driver_version = "550.54.15"\ngpu_count = 4\n')
    return path


async def allocator(host: Path, **flags: object) -> NvidiaGpuAllocator:
    f = Flags(host_file=str(host), gpu_allocation="lowest", nvidia_health_checks=False, **flags)
    return await NvidiaGpuAllocator.create(f, NvidiaGpuAllocator.resources(f))


async def joined(host: Path, ledger: Path, owner: str, linger: float = LINGER) -> NvidiaGpuAllocator:
    """An allocator of the host file's node that joined ``ledger`` as ``owner``."""
    made = await allocator(host)
    await made.join_ledger(str(ledger), owner, linger=linger)
    return made


@pytest.mark.asyncio
async def test_a_grant_is_answered_once_its_leases_are_written(tmp_path: Path, host_file: Path) -> None:
    ledger = tmp_path / "ledger"
    async with Runtime():
        a = await joined(host_file, ledger, A)
        assert await a.allocate(2, holder="c1") == {G[0], G[1]}
        assert leases(ledger) == {"195:0": (A, ("c1",)), "195:1": (A, ("c1",))}
        assert await a.allocate({G[3]}, holder="c2") is None
        assert leases(ledger)["195:3"] == (A, ("c2",))
        await a.close()


@pytest.mark.asyncio
async def test_two_owners_never_hold_one_unit_and_the_refusal_names_unit_owner_and_holder(
        tmp_path: Path, host_file: Path) -> None:
    ledger = tmp_path / "ledger"
    async with Runtime() as runtime:
        a, b = await joined(host_file, ledger, A), await joined(host_file, ledger, B)
        uuids = {gpu: a.info(gpu).uuid for gpu in G}
        assert await a.allocate(2, holder="c1") == {G[0], G[1]}
        # b chose 195:0 first (lowest), learnt from the ledger who holds it, and picked others
        assert await b.allocate(2, holder="exec-1") == {G[2], G[3]}
        assert leases(ledger) == {"195:0": (A, ("c1",)), "195:1": (A, ("c1",)), "195:2": (B, ("exec-1",)),
                                  "195:3": (B, ("exec-1",))}
        with pytest.raises(AllocatorError) as short:
            await a.allocate(1, holder="c2")
        assert str(short.value) == (
            "Requested 1 gpus but only 0 available (2 more held by other front doors of this node:"
            f" {uuids[G[2]]} (195:2), {uuids[G[3]]} (195:3) are held by {B} (running) for exec-1)")  # B once
        with pytest.raises(AllocatorError) as named:
            await b.allocate({G[0]}, holder="exec-2")
        assert str(named.value) == (
            f"{{195:0}} are not available ({uuids[G[0]]} (195:0) is held by {A} (running) for c1)")
        assert runtime.metrics.snapshot()["ledger/conflicts"] == 2
        assert (await b.state()).held_elsewhere == {
            "195:0": f"{uuids[G[0]]} (195:0) is held by {A} (running) for c1",
            "195:1": f"{uuids[G[1]]} (195:1) is held by {A} (running) for c1"}
        assert await b.available() == set()
        await a.close()
        await b.close()


@pytest.mark.asyncio
async def test_churn_on_one_unit_costs_no_file_work_and_an_unused_unit_goes_back(
        tmp_path: Path, host_file: Path) -> None:
    ledger = tmp_path / "ledger"
    async with Runtime():
        a = await joined(host_file, ledger, A, linger=3600)  # no tick in this test's life: only grants make jobs
        b = await joined(host_file, ledger, B, linger=0.01)
        assert await b.allocate({G[0]}, holder="exec-1") is None
        jobs = (await b.ledger_state()).jobs
        for n in range(20):  # the unit stays leased between its uses: no job at all
            await b.deallocate({G[0]})
            assert await b.allocate({G[0]}, holder=f"exec-{n + 2}") is None
        assert (await b.ledger_state()).jobs == jobs
        await b.deallocate({G[0]})
        # returned once unused for a linger period, then another owner may take it
        await until(lambda: "195:0" not in leases(ledger), "the unused unit went back")
        assert await a.allocate({G[0]}, holder="c1") is None
        assert leases(ledger) == {"195:0": (A, ("c1",))}
        await a.close()
        await b.close()


@pytest.mark.asyncio
async def test_a_dead_owners_units_wait_for_it_and_its_next_start_reconciles_them(
        tmp_path: Path, host_file: Path) -> None:
    ledger = tmp_path / "ledger"
    async with Runtime():
        a, b = await joined(host_file, ledger, A), await joined(host_file, ledger, B)
        assert await a.allocate({G[0]}, holder="c1") is None
        assert await a.allocate({G[1]}, holder="c2") is None
        terminate(a.pid)  # the agent dies: no leave, its leases stay
        await wait(a.pid)
        uuid0 = b.info(G[0]).uuid
        with pytest.raises(AllocatorError, match=(
                rf"\(195:0\) is held by {A} \(not running: its units wait for it to restart and reconcile, or"
                rf" for 'gpu-isolator ledger release --owner {A}'\) for c1")):
            await b.allocate({G[0]}, holder="exec-1")
        assert uuid0 in str((await b.state()).held_elsewhere["195:0"])

        again = await allocator(host_file)
        state = await again.join_ledger(str(ledger), A, linger=0.01)
        assert state.inherited == {G[0], G[1]}
        assert await again.available() == {G[2], G[3]}  # out of the pool until recovered
        await again.reclaim({G[0]}, {G[0]: "c1"})  # its container still runs
        assert await again.release_unclaimed() == ["195:1"]
        await until(lambda: leases(ledger) == {"195:0": (A, ("c1",))}, "195:1 went back, 195:0 kept")
        await b.refresh_ledger()
        assert await b.allocate({G[1]}, holder="exec-1") is None
        await again.close()
        await b.close()


@pytest.mark.asyncio
async def test_an_eight_gpu_refusal_names_the_owner_in_the_way_once(tmp_path: Path) -> None:
    """R-SH-5: every GPU of an 8-GPU node held by one stopped owner; each refusal (a count, named GPUs,
    a plugin's hold) lists the 8 units and says who holds them, its state and what to do, once."""
    host, ledger = tmp_path / "node.toml", tmp_path / "ledger"
    host.write_text('driver_version = "550.54.15"\ngpu_count = 8\n')
    gpus = [Gpu(195, minor) for minor in range(8)]
    async with Runtime():
        b = await joined(host, ledger, B)
        assert len(await b.allocate(8, holder="exec-1")) == 8
        await b.close()  # B stops; its command runs on, holding every GPU
        a = await joined(host, ledger, A)
        units = ", ".join(f"{a.info(gpu).uuid} ({gpu})" for gpu in gpus)
        owner = (f"are held by {B} (not running: its units wait for it to restart and reconcile, or for"
                 f" 'gpu-isolator ledger release --owner {B}') for exec-1")
        with pytest.raises(AllocatorError) as count:
            await a.allocate(1, holder="c1")
        with pytest.raises(AllocatorError) as named:
            await a.allocate(set(gpus), holder="c1")
        with pytest.raises(AllocatorError) as held:
            await a.hold(set(gpus), "ns/pod/gpu")
        assert str(count.value) == (
            f"Requested 1 gpus but only 0 available (8 more held by other front doors of this node: {units} {owner})")
        assert str(named.value) == f"{{{', '.join(map(str, gpus))}}} are not available ({units} {owner})"
        assert str(held.value) == f"Held by another front door of this node: {units} {owner}"
        for refusal in (count, named, held):
            text = str(refusal.value)
            assert text.count(B) == 2 and text.count("not running") == 1  # the owner, and its release command
            assert len(text) < 900, len(text)  # it was ~2,400 characters: the owner's sentence 8 times
        await a.close()


@pytest.mark.asyncio
async def test_one_owner_runs_once_on_a_node(tmp_path: Path, host_file: Path) -> None:
    async with Runtime():
        a, twin = await allocator(host_file), await allocator(host_file)
        await a.join_ledger(str(tmp_path / "ledger"), A)
        with pytest.raises(LedgerError, match=f"The node ledger owner {A} is already running on this node"):
            await twin.join_ledger(str(tmp_path / "ledger"), A)
        assert await twin.allocate(1) == {G[0]}  # it never joined: no lease taken
        await a.close()
        await twin.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("leave", ["close", "leaving Runtime()"])
async def test_close_returns_the_units_no_holder_has_and_keeps_the_held_ones(
        tmp_path: Path, host_file: Path, leave: str) -> None:
    """An allocator closed, or terminated by leaving ``Runtime()`` with no close (R-SH-4), returns its
    unused units (in their linger window too), keeps the held ones and releases the owner lock."""
    ledger = tmp_path / "ledger"
    async with Runtime():
        a = await allocator(host_file)
        await a.join_ledger(str(ledger), A, linger=3600)
        await a.allocate(2, holder="c1")
        await a.deallocate({G[1]})
        assert set(leases(ledger)) == {"195:0", "195:1"}  # kept a while, unused
        if leave == "close":
            await a.close()
            assert leases(ledger) == {"195:0": (A, ("c1",))}
    assert leases(ledger) == {"195:0": (A, ("c1",))} and owner_free(ledger, A)  # it may start again


@pytest.mark.asyncio
async def test_grants_in_flight_when_the_runtime_is_left_leave_no_lease(tmp_path: Path, host_file: Path) -> None:
    """R-SH-4: the runtime is left while grants wait for their leases (their job queued, or running in
    the ledger's thread): they fail, and whatever the job wrote goes back before the lock is released."""
    ledger = tmp_path / "ledger"
    async with Runtime():
        a = await joined(host_file, ledger, A)
        first = a.allocate(2, holder="c1")
        await asyncio.sleep(0)  # its job under way
        second = a.allocate({G[3]}, holder="c2")  # queued behind it
    for grant in (first, second):
        with pytest.raises(ProcessTerminated):
            await asyncio.wait_for(asyncio.ensure_future(grant), BOUND)  # answered: no grant waits forever
    assert leases(ledger) == {} and owner_free(ledger, A)


@pytest.mark.asyncio
async def test_a_mig_device_and_its_parent_gpu_are_never_held_by_two_owners(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    host = DATA / "h200-mig.toml"
    async with Runtime():
        mixed = await allocator(host, nvidia_mig_strategy="mixed")
        whole = await allocator(host, nvidia_mig_strategy="none")
        await mixed.join_ledger(str(ledger), A)
        await whole.join_ledger(str(ledger), B)
        device = MigDevice(Gpu(195, 0), 3, 0)
        assert await mixed.allocate_resources({"mig-1g.18gb": 1}, holder="c1") == {device}
        mig_uuid = mixed.info(device).uuid
        with pytest.raises(AllocatorError) as refused:
            await whole.allocate({Gpu(195, 0)}, holder="exec-1")
        assert f"conflicts with {mig_uuid} (195:0/gi3/ci0), held by {A} (running) for c1" in str(refused.value)
        assert await whole.allocate(1, holder="exec-2") == {Gpu(195, 1)}
        with pytest.raises(AllocatorError, match=rf"held by {B} \(running\) for exec-2"):
            await mixed.allocate(1, holder="c2")  # the mixed pool's whole GPU is 195:1
        await mixed.close()
        await whole.close()


@pytest.mark.asyncio
async def test_holders_share_units_inside_one_owner_and_a_hold_is_all_or_nothing(
        tmp_path: Path, host_file: Path) -> None:
    ledger = tmp_path / "ledger"
    async with Runtime():
        plugin = await joined(host_file, ledger, "kubelet-plugin:nvidia.com/gpu", linger=0.01)
        agent = await joined(host_file, ledger, A)
        await agent.allocate({G[2]}, holder="c1")
        await plugin.hold({G[0]}, "pod-a")
        await plugin.hold({G[0], G[1]}, "pod-b")  # time slicing: pod-a and pod-b share 195:0
        assert leases(ledger)["195:0"] == ("kubelet-plugin:nvidia.com/gpu", ("pod-a", "pod-b"))
        with pytest.raises(AllocatorError, match=rf"^Held by another front door of this node: .* \(195:2\) is held"
                                                 rf" by {A} \(running\) for c1$"):
            await plugin.hold({G[1], G[2]}, "pod-c")
        assert leases(ledger)["195:1"][1] == ("pod-b",)  # the refused hold changed nothing
        assert await plugin.let_go("pod-a") == set()  # 195:0 is still pod-b's
        assert await plugin.let_go("pod-b") == {G[0], G[1]}
        await until(lambda: set(leases(ledger)) == {"195:2"}, "units no pod holds went back")
        await plugin.close()
        await agent.close()


@pytest.mark.asyncio
async def test_a_front_door_hears_when_what_others_hold_changes(tmp_path: Path, host_file: Path) -> None:
    ledger = tmp_path / "ledger"
    async with Runtime():
        plugin, agent = await allocator(host_file), await allocator(host_file)
        state = await plugin.join_ledger(str(ledger), "dra-plugin:gpu.isolator.dev")
        await agent.join_ledger(str(ledger), A, linger=0.01)
        waiting = plugin.ledger_since(state.generation)
        await agent.allocate({G[1]}, holder="c1")
        await plugin.refresh_ledger()  # a plugin's pass reads the ledger once
        changed = await asyncio.wait_for(waiting, BOUND)
        assert set(changed.elsewhere) == {G[1]} and changed.elsewhere[G[1]].lease.holders == ("c1",)
        waiting = plugin.ledger_since(changed.generation)
        await agent.deallocate({G[1]})
        await until(lambda: not leases(ledger), "195:1 went back")
        await plugin.refresh_ledger()
        assert (await asyncio.wait_for(waiting, BOUND)).elsewhere == {}
        await plugin.close()
        await agent.close()


@pytest.mark.asyncio
async def test_health_the_owner_sees_is_reported_in_the_ledger(tmp_path: Path, host_file: Path) -> None:
    ledger = tmp_path / "ledger"
    async with Runtime():
        a = await joined(host_file, ledger, A)
        await a.mark_unhealthy(G[3], "Xid 79")

        def reported() -> dict:
            directory = LedgerDirectory.open(str(ledger))
            try:
                return directory.view().health
            finally:
                directory.close()

        await until(lambda: reported() == {A: {a.info(G[3]).uuid: "Xid 79"}}, "the health report")
        assert current_runtime() is not None
        await a.close()


@pytest.mark.asyncio
async def test_a_plugin_reconciles_by_holding_again_what_its_own_truth_says(tmp_path: Path, host_file: Path) -> None:
    """A front door without an isolator (the Kubernetes plugins) reconciles after a restart by holding again the
    units its own truth assigns (PodResources, its checkpoint), then returning the rest."""
    ledger = tmp_path / "ledger"
    plugin_owner = "kubelet-plugin:nvidia.com/gpu"
    async with Runtime():
        before = await allocator(host_file)
        await before.join_ledger(str(ledger), plugin_owner)
        await before.hold({G[0], G[1]}, "pod-a")
        terminate(before.pid)  # the plugin dies with its pods running
        await wait(before.pid)
        after = await allocator(host_file)
        state = await after.join_ledger(str(ledger), plugin_owner, linger=0.01)
        assert state.inherited == {G[0], G[1]}
        await after.hold({G[0]}, "pod-a")  # still assigned; 195:1's pod is gone
        assert await after.release_unclaimed() == ["195:1"]
        await until(lambda: leases(ledger) == {"195:0": (plugin_owner, ("pod-a",))}, "195:1 went back")
        await after.close()


@pytest.mark.asyncio
async def test_a_unit_leased_in_an_earlier_run_and_no_longer_managed_waits_for_recovery(
        tmp_path: Path, host_file: Path) -> None:
    ledger = tmp_path / "ledger"
    async with Runtime():
        before = await allocator(host_file)
        await before.join_ledger(str(ledger), A)
        await before.allocate({G[3]}, holder="c1")
        terminate(before.pid)
        await wait(before.pid)
        fewer = await allocator(host_file, resources="gpus:2", nvidia_gpu_devices=[0, 1])  # reconfigured
        await fewer.join_ledger(str(ledger), A, linger=0.01)
        await fewer.allocate(1, holder="c2")  # jobs run, and keep 195:3 until recovery says
        assert "195:3" in leases(ledger)
        assert await fewer.release_unclaimed() == [before.info(G[3]).uuid]
        await until(lambda: "195:3" not in leases(ledger), "the unmanaged unit went back after recovery")
        await fewer.close()


async def advance(seconds: float) -> None:
    """Move the paused runtime clock on, then wait until every job it started is done."""
    Clock.advance(seconds)
    await Clock.settle()


async def state_until(a: NvidiaGpuAllocator, check: Callable[[LedgerState], bool], what: str) -> None:
    """Wait (bounded) until the allocator's ledger state is one ``check`` holds for: a job
    the clock started has run and been heard, however busy the machine is."""
    state = await a.ledger_state()
    deadline = asyncio.get_running_loop().time() + BOUND
    while not check(state):
        assert asyncio.get_running_loop().time() < deadline, f"not within {BOUND:g} s: {what} ({state})"
        await asyncio.sleep(0.005)
        state = await a.ledger_state()


@pytest.mark.asyncio
async def test_a_ledger_that_cannot_be_written_is_retried_with_a_growing_pause_and_the_error_logged_once(
        tmp_path: Path, host_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A full ledger filesystem (every inode taken: a lease can be removed, not written) fails each job
    that writes; the link retries after 0.1, 0.2, 0.4 s (not at once, again and again), logs the error
    once, and writes what waited once the filesystem has room."""
    with inode_limited(tmp_path / "fs") as fs:
        ledger = fs.path / "ledger"
        async with Runtime() as runtime:
            a = await joined(host_file, ledger, A, linger=0.01)
            assert await a.allocate({G[0]}, holder="c1") is None
            Clock.pause()
            fs.leave_free(0)
            await a.deallocate({G[0]})
            assert await a.allocate({G[0]}, holder="c2") is None  # leased already: answered with no job
            with pytest.raises(AllocatorError, match=r"^The node ledger .* could not be changed: \[Errno 28\] No"
                                                     r" space left on device: '\.GPU-[-0-9a-f]+\.lease\.tmp'$"):
                await a.allocate({G[1]}, holder="c3")  # its job (with c2's holder change) fails
            first = await a.ledger_state()
            assert first.failing == 1 and runtime.metrics.snapshot()["ledger/failing_jobs"] == 1
            for retries, pause in enumerate((0.1, 0.2, 0.4)):  # c2's holder change waits: retried once each pause
                await advance(pause - 0.001)
                assert (await a.ledger_state()).jobs == first.jobs + retries  # never sooner
                await advance(0.002)  # past it (a margin no rounding of the frozen clock's sums eats)
                await state_until(a, lambda state: state.jobs == first.jobs + retries + 1, f"retry {retries + 1} ran")
            state = await a.ledger_state()
            assert (state.failing, state.jobs) == (4, first.jobs + 3)
            assert leases(ledger) == {"195:0": (A, ("c1",))}
            [failed] = [r.getMessage() for r in caplog.records if "a job of" in r.getMessage()]
            assert failed.startswith(f"Node ledger {ledger}: a job of {A} failed: [Errno 28] No space left on device")
            assert failed.endswith(" (retried in 0.1 s, doubling up to 5 s while it fails)")
            fs.refill()
            await advance(0.802)
            await state_until(a, lambda state: state.failing == 0, "the retry after 0.8 s worked")
            assert leases(ledger) == {"195:0": (A, ("c2",))}
            assert f"Node ledger {ledger}: jobs of {A} work again (after 4 failed)" in caplog.text
            assert await a.available() == {G[1], G[2], G[3]}
            Clock.resume()
            await a.close()


@pytest.mark.asyncio
async def test_a_job_that_fails_half_way_leaves_no_lease_behind(tmp_path: Path, host_file: Path) -> None:
    """Room for one lease: a grant of two writes the first and fails on the second. The grant fails, and
    the lease it left is adopted by the retry and returned once unused: another front door may take it."""
    with inode_limited(tmp_path / "fs") as fs:
        ledger = fs.path / "ledger"
        async with Runtime():
            a, b = await joined(host_file, ledger, A, linger=0.01), await joined(host_file, ledger, B, linger=0.01)
            Clock.pause()
            fs.leave_free(1)
            with pytest.raises(AllocatorError, match=r"could not be changed: \[Errno 28\] No space left on device"):
                await a.allocate(2, holder="c1")
            assert leases(ledger) == {"195:0": (A, ("c1",))}  # written before the second lease failed
            fs.refill()
            await advance(0.1)  # the retry reads the ledger: the lease is ours, unused
            for _ in range(3):  # unused for a whole linger period: returned
                await advance(0.01)
            assert leases(ledger) == {}
            assert (await a.ledger_state()).failing == 0
            Clock.resume()
            assert await b.allocate({G[0]}, holder="exec-1") is None
            await a.close()
            await b.close()


@pytest.mark.asyncio
async def test_recovery_calls_only_what_the_kernel_grants_a_conflict_not_a_quarantine_of_others_units(
        tmp_path: Path, host_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Recovery holds back every free unit for a container of unknown state (it may reach any): a unit
    another front door holds stays that front door's, out of this pool, and is no conflict; a unit the
    kernel grants a recovered container while another front door holds it is one, said loudly."""
    ledger = tmp_path / "ledger"
    async with Runtime() as runtime:
        b = await joined(host_file, ledger, B)
        assert await b.allocate({G[2], G[3]}, holder="exec-1") is None
        a = await joined(host_file, ledger, A)
        # c1's cgroup grants 195:3 (exact); c2's state is unknown: 195:0-2 are held back for it
        await a.reclaim(set(G), {G[0]: "c2", G[1]: "c2", G[2]: "c2", G[3]: "c1"}, quarantine={G[0], G[1], G[2]})
        assert leases(ledger) == {"195:0": (A, ("c2",)), "195:1": (A, ("c2",)), "195:2": (B, ("exec-1",)),
                                  "195:3": (B, ("exec-1",))}
        assert await a.available() == set()
        assert runtime.metrics.snapshot()["ledger/conflicts"] == 1
        [loud] = [r.getMessage() for r in caplog.records if "two front doors grant them" in r.getMessage()]
        assert "(195:3) is held by" in loud and "(195:2)" not in loud
        [held_back] = [r.getMessage() for r in caplog.records if "of unknown state are another" in r.getMessage()]
        assert "(195:2) is held by" in held_back and "(195:3)" not in held_back
        await a.close()
        await b.close()
