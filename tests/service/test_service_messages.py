"""R-SV-1 through the wire: a ``gpu-isolator serve`` OS process (in-memory
backend: no root needed) asked by a ``ServiceClient`` in this test's own
runtime; its answers come back to the sender's PID as messages. Also the
state route, the runtime's endpoints, the waiting line (first come, first
served), topology-aware grants, and the commands' errors."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest

from isolators.service import (
    Cleanup,
    Prepare,
    Queued,
    ServiceClient,
    Start,
    Update,
    Usage,
)
from runtime import PID, Runtime, dispatch, spawn
from tests.support.services import ROOT, ServeProcess, ask, client_of, gpus_of

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def state_of(service: ServeProcess) -> dict[str, Any]:
    """GET the state in a thread (the loop keeps running: our messages go out)."""
    return await anyio.to_thread.run_sync(service.state)


async def wait_state(service: ServeProcess, predicate: Any) -> dict[str, Any]:
    return await anyio.to_thread.run_sync(service.wait_state, predicate)


def http_get(service: ServeProcess, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://{service.address}{path}", timeout=10) as response:
        return response.status, response.read()


async def test_prepare_update_usage_cleanup_answer_the_sender(memory_service: ServeProcess) -> None:
    service = memory_service
    async with client_of(service) as client:
        prepared = await ask(client, "prepare", Prepare(request="r1", container_id="c1", gpus=2))
        assert prepared.error is None and prepared.token is None  # no command: not an exec container
        assert [g.minor for g in prepared.gpus] == [0, 1]
        uuids = [g.uuid for g in prepared.gpus]
        assert all(uuid.startswith("GPU-") for uuid in uuids)
        assert prepared.env == {"NVIDIA_VISIBLE_DEVICES": ",".join(uuids), "CUDA_VISIBLE_DEVICES": ",".join(uuids)}
        state = await state_of(service)
        assert state["containers"]["c1"]["gpus"] == [0, 1] and state["containers"]["c1"]["uuids"] == uuids
        assert state["containers"]["c1"]["client"] == str(client.pid)
        assert state["free"] == [2, 3] and state["unhealthy"] == {} and state["waiting"] == []

        updated = await ask(client, "update", Update(request="r2", container_id="c1", gpus=3))
        assert updated.error is None and [g.minor for g in updated.gpus] == [0, 1, 2]
        statistics = await ask(client, "usage", Usage(request="r3", container_id="c1"))
        assert statistics.error is None and statistics.statistics.gpus_allocated == 3
        assert [(g.minor, g.memory_used_bytes) for g in statistics.statistics.gpus] == [
            (m, 100 * (m + 1) << 20) for m in (0, 1, 2)]

        cleaned = await ask(client, "cleanup", Cleanup(request="r4", container_id="c1"))
        assert cleaned.error is None and cleaned.released
        state = await state_of(service)
        assert state["containers"] == {} and state["free"] == [0, 1, 2, 3]


async def test_refusals_are_one_line_answers(memory_service: ServeProcess) -> None:
    service = memory_service
    async with client_of(service) as client:
        assert (await ask(client, "prepare", Prepare(request="a", container_id="held", gpus=2))).error is None

        async def refusal(name: str, body: Any) -> str:
            answer = await ask(client, name, body)
            assert answer.error is not None, answer
            return answer.error

        assert await refusal("prepare", Prepare(request="b", container_id="held", gpus=1)) == \
            "Container has already been prepared"
        assert await refusal("prepare", Prepare(request="c", container_id="big", gpus=3)) == \
            "Requested 3 gpus but only 2 available"
        assert await refusal("prepare", Prepare(request="d", container_id="huge", gpus=5, wait=True)) == \
            "Requested 5 gpus but the node has only 4"
        assert "'../escape'" in await refusal("prepare", Prepare(request="e", container_id="../escape", gpus=1))
        assert "in-memory device backend, which enforces nothing" in await refusal(
            "prepare", Prepare(request="f", container_id="x", gpus=1, command=["true"]))
        assert await refusal("update", Update(request="g", container_id="nobody", gpus=1)) == "Unknown container"
        assert await refusal("usage", Usage(request="h", container_id="nobody")) == "Unknown container"
        assert "not an exec container" in await refusal(
            "start", Start(request="i", container_id="held", token="guess", pid=1))
        for request, name in (("j", "held"), ("k", "nobody")):  # idempotent, as in Mesos
            cleaned = await ask(client, "cleanup", Cleanup(request=request, container_id=name))
            assert cleaned.error is None and cleaned.released
        assert (await state_of(service))["containers"] == {}


async def test_waiting_requests_are_served_first_come_first_served(memory_service: ServeProcess) -> None:
    service = memory_service
    async with client_of(service) as client:
        notes: list[Queued] = []
        client.on_queued = notes.append
        assert (await ask(client, "prepare", Prepare(request="a", container_id="a", gpus=3))).error is None
        first = dispatch(client.pid, ServiceClient.ask, "prepare", Prepare(request="b", container_id="b", gpus=2,
                                                                             wait=True))
        second = dispatch(client.pid, ServiceClient.ask, "prepare", Prepare(request="c", container_id="c", gpus=1,
                                                                              wait=True))
        state = await wait_state(service, lambda s: len(s["waiting"]) == 2)
        assert [(w["container_id"], w["gpus"]) for w in state["waiting"]] == [("b", 2), ("c", 1)]
        assert state["free"] == [3]  # free, but "c" is behind "b"
        assert [(n.container_id, n.position, n.free) for n in notes] == [("b", 1, 1), ("c", 2, 1)]
        refused = await ask(client, "prepare", Prepare(request="d", container_id="d", gpus=1))
        assert refused.error == ("Requested 1 gpus but only 0 available: the free GPUs are held for 2 earlier"
                                 " request(s) for 3 GPU(s) waiting in line")
        assert first.is_pending() and second.is_pending()

        await ask(client, "cleanup", Cleanup(request="a-", container_id="a"))
        with anyio.fail_after(20):
            got_first, got_second = await first, await second
        assert [g.minor for g in got_first.gpus] == [0, 1] and [g.minor for g in got_second.gpus] == [2]
        assert gpus_of(await state_of(service)) == {"b": [0, 1], "c": [2]}

        # A waiting request can be withdrawn by cleaning its container up.
        late = dispatch(client.pid, ServiceClient.ask, "prepare", Prepare(request="e", container_id="e", gpus=2,
                                                                            wait=True))
        await wait_state(service, lambda s: [w["container_id"] for w in s["waiting"]] == ["e"])
        cleaned = await ask(client, "cleanup", Cleanup(request="e-", container_id="e"))
        assert cleaned.error is None and cleaned.released
        with anyio.fail_after(10):
            assert "cancelled by a cleanup" in (await late).error
        for name in ("b", "c"):
            await ask(client, "cleanup", Cleanup(request=f"{name}-", container_id=name))
    await wait_state(service, lambda s: not s["containers"] and not s["waiting"])


async def test_a_waiting_client_that_goes_away_leaves_the_line(memory_service: ServeProcess) -> None:
    service = memory_service
    async with client_of(service) as holder:
        assert (await ask(holder, "prepare", Prepare(request="a", container_id="hold", gpus=4))).error is None
        async with Runtime(listen="127.0.0.1:0"):
            waiter = ServiceClient(PID.parse(f"gpu-isolator@{service.address}"), id="waiter")
            spawn(waiter)
            dispatch(waiter.pid, ServiceClient.ask, "prepare", Prepare(request="w", container_id="w", gpus=1,
                                                                         wait=True))
            await wait_state(service, lambda s: len(s["waiting"]) == 1)
        await wait_state(service, lambda s: s["waiting"] == [])  # its runtime closed: the link broke
        assert list((await state_of(service))["containers"]) == ["hold"]  # a non-exec container outlives its sender
        await ask(holder, "cleanup", Cleanup(request="b", container_id="hold"))


async def test_state_route_and_the_runtime_endpoints(memory_service: ServeProcess) -> None:
    service = memory_service
    status, body = http_get(service, "/gpu-isolator/state")
    state = json.loads(body)
    assert status == 200 and set(state) >= {"containers", "free", "unhealthy", "waiting", "total"}
    assert state["backend"] == "memory" and state["address"] == f"gpu-isolator@{service.address}"
    status, body = http_get(service, "/__processes__")
    assert "gpu-isolator" in {process["id"] for process in json.loads(body)}
    status, body = http_get(service, "/metrics")
    from prometheus_client.parser import text_string_to_metric_families

    names = {family.name for family in text_string_to_metric_families(body.decode())}
    assert {"service_containers", "service_waiting", "service_releasing"} <= names


def served_metrics(service: ServeProcess) -> dict[str, float]:
    """The service's ``/metrics``, parsed by prometheus-client: {sample name: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_get(service, "/metrics")
    assert status == 200
    return {sample.name: sample.value for family in text_string_to_metric_families(body.decode())
            for sample in family.samples if not sample.labels}


async def test_the_served_metrics_follow_a_prepare_and_a_cleanup(memory_service: ServeProcess) -> None:
    service = memory_service
    before = await anyio.to_thread.run_sync(served_metrics, service)
    assert (before["allocator_gpus_total"], before["allocator_gpus_free"], before["allocator_gpus_allocated"]) == (
        4, 4, 0)
    async with client_of(service) as client:
        assert (await ask(client, "prepare", Prepare(request="m1", container_id="m1", gpus=3))).error is None
        held = await anyio.to_thread.run_sync(served_metrics, service)
        assert (held["allocator_gpus_free"], held["allocator_gpus_allocated"], held["isolator_containers"]) == (
            1, 3, before["isolator_containers"] + 1)
        assert held["isolator_prepares_total"] == before["isolator_prepares_total"] + 1
        assert held["isolator_prepare_seconds_count"] == before["isolator_prepare_seconds_count"] + 1
        assert held["devices_operations_total"] > before["devices_operations_total"]
        assert (await ask(client, "cleanup", Cleanup(request="m2", container_id="m1"))).error is None
    after = await anyio.to_thread.run_sync(served_metrics, service)
    assert (after["allocator_gpus_free"], after["allocator_gpus_allocated"]) == (4, 0)
    assert after["isolator_cleanups_total"] == before["isolator_cleanups_total"] + 1


async def test_exec_picks_the_best_connected_gpus(serve_factory) -> None:
    service = serve_factory("memory", host_file=str(ROOT / "examples" / "dgx-8gpu.toml"),
                            gpu_allocation="topology").start()
    async with client_of(service) as client:
        one = await ask(client, "prepare", Prepare(request="a", container_id="one", gpus=1))
        four = await ask(client, "prepare", Prepare(request="b", container_id="four", gpus=4))
        islands = ({0, 1, 2, 3}, {4, 5, 6, 7})
        taken = one.gpus[0].minor
        other = next(island for island in islands if taken not in island)
        assert {g.minor for g in four.gpus} == other  # one NVLink island, not a mix


async def test_exec_is_refused_on_the_in_memory_backend(memory_service: ServeProcess) -> None:
    done = await anyio.run_process([sys.executable, "-m", "isolators", "exec", "--agent", memory_service.address,
                                    "--gpus", "1", "--", "true"], cwd=ROOT, check=False)
    stderr = done.stderr.decode()
    assert done.returncode == 125
    assert stderr.startswith("gpu-isolator exec: error: this gpu-isolator service runs the in-memory device"
                             " backend, which enforces nothing")
    assert stderr.count("\n") == 1


def test_command_errors_are_one_line_and_non_zero(tmp_path: Path) -> None:
    bad_flags = tmp_path / "flags.toml"
    bad_flags.write_text("no_such_flag = 1\n")
    cases = [
        (("serve", "--listen", "127.0.0.1:0", "--flags", str(tmp_path / "missing.json")), "Failed to read flags file"),
        (("serve", "--listen", "127.0.0.1:0", "--flags", str(bad_flags)), "Failed to load unknown flag 'no_such_flag'"),
        (("serve", "--listen", "nowhere", "--device_backend=memory"), "Invalid address 'nowhere'"),
        (("status", "--agent", "127.0.0.1:1"), "cannot reach the gpu-isolator service at 127.0.0.1:1"),
        (("exec", "--gpus", "1"), "no command given"),
        (("exec", "--agent", "no-port", "--gpus", "1", "--", "true"), "Invalid address 'no-port'"),
    ]
    running = [(args, text, subprocess.Popen([sys.executable, "-m", "isolators", *args], cwd=ROOT, text=True,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE))
               for args, text in [*cases, (("exec", "--agent", "127.0.0.1:1", "--gpus", "1", "--", "true"), None)]]
    for args, text, process in running:
        _, stderr = process.communicate(timeout=60)
        if text is None:  # nothing listens there: the command never runs
            assert process.returncode == 125
            assert stderr == ("gpu-isolator exec: error: cannot reach the gpu-isolator service at 127.0.0.1:1 (is"
                              " 'gpu-isolator serve' running there?)\n")
            continue
        assert process.returncode == 2, (args, stderr)
        assert text in stderr and stderr.count("\n") == 1, (args, stderr)


async def test_serve_stops_on_sigterm_and_tells_whoever_waits(serve_factory) -> None:
    service = serve_factory("memory").start()
    async with client_of(service) as client:
        assert (await ask(client, "prepare", Prepare(request="a", container_id="all", gpus=4))).error is None
        waiting = dispatch(client.pid, ServiceClient.ask, "prepare", Prepare(request="b", container_id="b", gpus=1,
                                                                               wait=True))
        await wait_state(service, lambda s: len(s["waiting"]) == 1)
        assert await anyio.to_thread.run_sync(service.stop) == 0
        with anyio.fail_after(10):
            answer = await waiting
        assert answer.error == "the gpu-isolator service is stopping; ask again once it runs"
