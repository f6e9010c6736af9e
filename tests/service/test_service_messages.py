"""R-SV-1 with R-SC-1/6 through the wire: a ``gpu-isolator serve`` OS process
(in-memory backend) asked on its unix socket -- answers on the same
connection -- and over TCP by an agent with the bearer credential (answers
to its PID) or without it (401, nothing changes). Also the runtime's
endpoints, the waiting line (first come, first served), topology-aware
grants, and the commands' errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest

from isolators.service import Refused
from runtime import PID, Process, Runtime, spawn
from tests.service.conftest import SECRET
from tests.support.services import ROOT, ServeProcess, ask, connect, gpus_of, tcp_message


def http_get(service: ServeProcess, path: str, secret: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{service.address}{path}",
                                     headers={"Authorization": f"Bearer {secret}"} if secret else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_prepare_update_usage_cleanup_answer_on_the_connection(memory_service: ServeProcess) -> None:
    service = memory_service
    with connect(service) as client:
        prepared = client.ask("prepare", {"container_id": "c1", "gpus": 2}).body
        assert prepared["error"] is None and "token" not in prepared
        assert [g["minor"] for g in prepared["gpus"]] == [0, 1]
        uuids = [g["uuid"] for g in prepared["gpus"]]
        assert all(uuid.startswith("GPU-") for uuid in uuids)
        assert prepared["env"] == {"NVIDIA_VISIBLE_DEVICES": ",".join(uuids), "CUDA_VISIBLE_DEVICES": ",".join(uuids)}
        state = service.state()
        view = state["containers"]["c1"]
        assert view["gpus"] == [0, 1] and view["uuids"] == uuids
        assert (view["uid"], view["user"], view["client"]) == (0, "root", f"pid {os.getpid()}")  # from the kernel
        assert state["free"] == [2, 3] and state["unhealthy"] == {} and state["waiting"] == []

        updated = client.ask("update", {"container_id": "c1", "gpus": 3}).body
        assert updated["error"] is None and [g["minor"] for g in updated["gpus"]] == [0, 1, 2]
        statistics = client.ask("usage", {"container_id": "c1"}).body
        assert statistics["error"] is None and statistics["statistics"]["gpus_allocated"] == 3
        assert [(g["minor"], g["memory_used_bytes"]) for g in statistics["statistics"]["gpus"]] == [
            (m, 100 * (m + 1) << 20) for m in (0, 1, 2)]

        cleaned = client.ask("cleanup", {"container_id": "c1"}).body
        assert cleaned["error"] is None and cleaned["released"]
        state = service.state()
        assert state["containers"] == {} and state["free"] == [0, 1, 2, 3]


def test_refusals_are_one_line_answers(memory_service: ServeProcess) -> None:
    service = memory_service
    with connect(service) as client:
        assert client.ask("prepare", {"container_id": "held", "gpus": 2}).body["error"] is None

        def refusal(verb: str, **body: Any) -> str:
            answer = client.ask(verb, body).body
            assert answer["error"] is not None, answer
            return answer["error"]

        assert refusal("prepare", container_id="held", gpus=1) == "Container has already been prepared"
        assert refusal("prepare", container_id="big", gpus=3) == "Requested 3 gpus but only 2 available"
        assert refusal("prepare", container_id="huge", gpus=5, wait=True) == "Requested 5 gpus but the node has only 4"
        assert "'../escape'" in refusal("prepare", container_id="../escape", gpus=1)
        assert refusal("update", container_id="nobody", gpus=1) == "Unknown container"
        assert refusal("usage", container_id="nobody") == "Unknown container"
        for name in ("held", "nobody"):  # idempotent, as in Mesos
            cleaned = client.ask("cleanup", {"container_id": name}).body
            assert cleaned["error"] is None and cleaned["released"]
    assert service.state()["containers"] == {}


def test_a_frame_that_is_not_a_request_is_refused_and_closes_only_that_connection(memory_service: ServeProcess) -> None:
    service = memory_service
    with connect(service) as bystander:
        for verb, body, text in (("start", {"container_id": "x", "token": "t", "pid": 1}, "unknown request 'start'"),
                                 ("prepare", {"container_id": "x", "gpus": "two"}, "does not decode"),
                                 ("update", {"container_id": "x"}, "does not decode")):
            with connect(service) as client:
                with pytest.raises(Refused, match=text):
                    client.ask(verb, body)
        with connect(service) as client:  # descriptors with anything but an exec request
            with pytest.raises(Refused, match="descriptors came with a 'usage' request"):
                client.ask("usage", {"container_id": "x"}, fds=(0,))
        assert bystander.ask("state", {}).verb == "state"  # its connection was never in question


def test_waiting_requests_are_served_first_come_first_served(memory_service: ServeProcess) -> None:
    service = memory_service
    with connect(service) as holder, connect(service) as first, connect(service) as second:
        assert holder.ask("prepare", {"container_id": "a", "gpus": 3}).body["error"] is None
        notes: list[dict] = []
        first.on_queued = second.on_queued = notes.append
        first.send("prepare", {"request": "b", "container_id": "b", "gpus": 2, "wait": True})
        service.wait_state(lambda s: len(s["waiting"]) == 1)
        second.send("prepare", {"request": "c", "container_id": "c", "gpus": 1, "wait": True})
        state = service.wait_state(lambda s: len(s["waiting"]) == 2)
        assert [(w["container_id"], w["gpus"]) for w in state["waiting"]] == [("b", 2), ("c", 1)]
        assert state["free"] == [3]  # free, but "c" is behind "b"
        refused = holder.ask("prepare", {"container_id": "d", "gpus": 1}).body
        assert refused["error"] == ("Requested 1 gpus but only 0 available: the free GPUs are held for 2 earlier"
                                    " request(s) for 3 GPU(s) waiting in line")

        assert holder.ask("cleanup", {"container_id": "a"}).body["released"]
        got_first, got_second = first.receive(20).body, second.receive(20).body
        assert [(n["container_id"], n["position"], n["free"]) for n in notes] == [("b", 1, 1), ("c", 2, 1)]
        assert [g["minor"] for g in got_first["gpus"]] == [0, 1] and [g["minor"] for g in got_second["gpus"]] == [2]
        assert gpus_of(service.state()) == {"b": [0, 1], "c": [2]}

        # A waiting request can be withdrawn by cleaning its container up.
        first.send("prepare", {"request": "e", "container_id": "e", "gpus": 2, "wait": True})
        service.wait_state(lambda s: [w["container_id"] for w in s["waiting"]] == ["e"])
        cleaned = holder.ask("cleanup", {"container_id": "e"}).body
        assert cleaned["error"] is None and cleaned["released"]
        assert "cancelled by a cleanup" in first.receive(10).body["error"]
        for name in ("b", "c"):
            holder.ask("cleanup", {"container_id": name})
    service.wait_state(lambda s: not s["containers"] and not s["waiting"])


def test_a_waiting_client_that_goes_away_leaves_the_line(memory_service: ServeProcess) -> None:
    service = memory_service
    with connect(service) as holder:
        assert holder.ask("prepare", {"container_id": "hold", "gpus": 4}).body["error"] is None
        with connect(service) as waiter:
            waiter.send("prepare", {"request": "w", "container_id": "w", "gpus": 1, "wait": True})
            service.wait_state(lambda s: len(s["waiting"]) == 1)
        service.wait_state(lambda s: s["waiting"] == [])  # its connection closed
        assert list(service.state()["containers"]) == ["hold"]  # a non-exec container outlives its connection
        holder.ask("cleanup", {"container_id": "hold"})


def test_tcp_needs_the_credential_and_metrics_stay_readable(memory_service: ServeProcess) -> None:
    """R-SC-6: without ``Authorization: Bearer`` a message or the state route
    is 401 and changes nothing; with it an agent's prepare is answered to its
    PID; /metrics and /__processes__ stay readable."""
    service = memory_service
    status, body = http_get(service, "/gpu-isolator/state")
    assert (status, b"Authorization: Bearer <secret>" in body) == (401, True)
    assert http_get(service, "/gpu-isolator/state", secret="wrong")[0] == 401
    status, body = http_get(service, "/gpu-isolator/state", secret=SECRET)
    state = json.loads(body)
    assert status == 200 and set(state) >= {"containers", "free", "unhealthy", "waiting", "total"}
    assert state["backend"] == "memory" and state["address"] == f"gpu-isolator@{service.address}"
    status, body = http_get(service, "/__processes__")
    assert status == 200 and "gpu-isolator" in {process["id"] for process in json.loads(body)}
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_get(service, "/metrics")
    names = {family.name for family in text_string_to_metric_families(body.decode())}
    assert status == 200 and {"service_containers", "service_waiting", "service_unauthorized"} <= names

    async def agent() -> None:
        class Agent(Process):
            def __init__(self) -> None:
                super().__init__("agent")
                self.answers: list[bytes] = []
                self.got = anyio.Event()

            def initialize(self) -> None:
                self.install("prepared", self.prepared, bytes)

            def prepared(self, sender: PID, body: bytes) -> None:
                self.answers.append(body)
                self.got.set()

        async with Runtime(listen="127.0.0.1:0") as rt:
            me = Agent()
            spawn(me)
            sender = f"agent@{rt.address}"
            before = service.metrics()["service_unauthorized_total"]
            refused = await anyio.to_thread.run_sync(
                tcp_message, service, "prepare", {"request": "r", "container_id": "by-agent", "gpus": 1}, sender)
            assert refused[0] == 401
            assert service.metrics()["service_unauthorized_total"] == before + 1
            assert "by-agent" not in service.state()["containers"] and not me.answers
            accepted = await anyio.to_thread.run_sync(
                tcp_message, service, "prepare", {"request": "r", "container_id": "by-agent", "gpus": 1}, sender,
                SECRET)
            assert accepted[0] == 202
            with anyio.fail_after(10):
                await me.got.wait()
            answer = json.loads(me.answers[0])
            assert answer["container_id"] == "by-agent" and [g["minor"] for g in answer["gpus"]] == [0]
            assert service.state()["containers"]["by-agent"]["user"] == "root"
            cleaned = await anyio.to_thread.run_sync(
                tcp_message, service, "cleanup", {"request": "c", "container_id": "by-agent"}, sender, SECRET)
            assert cleaned[0] == 202

    anyio.run(agent)
    service.wait_state(lambda s: not s["containers"])


def test_the_served_metrics_follow_a_prepare_and_a_cleanup(memory_service: ServeProcess) -> None:
    service = memory_service
    before = service.metrics()
    assert (before["allocator_gpus_total"], before["allocator_gpus_free"], before["allocator_gpus_allocated"]) == (
        4, 4, 0)
    assert ask(service, "prepare", container_id="m1", gpus=3)["error"] is None
    held = service.metrics()
    assert (held["allocator_gpus_free"], held["allocator_gpus_allocated"], held["isolator_containers"]) == (
        1, 3, before["isolator_containers"] + 1)
    assert held["isolator_prepares_total"] == before["isolator_prepares_total"] + 1
    assert held["isolator_prepare_seconds_count"] == before["isolator_prepare_seconds_count"] + 1
    assert held["devices_operations_total"] > before["devices_operations_total"]
    assert ask(service, "cleanup", container_id="m1")["error"] is None
    after = service.metrics()
    assert (after["allocator_gpus_free"], after["allocator_gpus_allocated"]) == (4, 0)
    assert after["isolator_cleanups_total"] == before["isolator_cleanups_total"] + 1


def test_exec_picks_the_best_connected_gpus(serve_factory) -> None:
    service = serve_factory("memory", host_file=str(ROOT / "examples" / "dgx-8gpu.toml"),
                            gpu_allocation="topology").start()
    one = ask(service, "prepare", container_id="one", gpus=1)
    four = ask(service, "prepare", container_id="four", gpus=4)
    islands = ({0, 1, 2, 3}, {4, 5, 6, 7})
    taken = one["gpus"][0]["minor"]
    other = next(island for island in islands if taken not in island)
    assert {g["minor"] for g in four["gpus"]} == other  # one NVLink island, not a mix


def test_exec_is_refused_on_the_in_memory_backend(memory_service: ServeProcess) -> None:
    code, out, err = memory_service.finish(memory_service.exec("true", gpus=1))
    assert code == 125
    assert err.startswith("gpu-isolator exec: error: this gpu-isolator service runs the in-memory device"
                          " backend, which enforces nothing")
    assert err.count("\n") == 1


def test_command_errors_are_one_line_and_non_zero(tmp_path: Path) -> None:
    bad_flags = tmp_path / "flags.toml"
    bad_flags.write_text("no_such_flag = 1\n")
    nowhere = str(tmp_path / "no-service.sock")
    readable = tmp_path / "secret"
    readable.write_text("s3cret\n")
    os.chmod(readable, 0o644)
    cases = [
        (("serve", f"--socket={nowhere}", "--listen=127.0.0.1:0", f"--credential={readable}",
          "--device_backend=memory", f"--work_dir={tmp_path / 'work'}"), f"Credential '{readable}' has mode 0644: others may read it" if os.geteuid() == 0
         else f"Credential '{readable}' is owned by uid {os.geteuid()}, not root"),
        (("serve", f"--socket={nowhere}", "--flags", str(tmp_path / "missing.json")), "Failed to read flags file"),
        (("serve", f"--socket={nowhere}", "--flags", str(bad_flags)), "Failed to load unknown flag 'no_such_flag'"),
        (("serve", "--listen", "nowhere", "--device_backend=memory"), "Invalid address 'nowhere'"),
        (("status", f"--socket={nowhere}"), f"cannot reach the gpu-isolator service at {nowhere}"),
        (("exec", "--gpus", "1"), "no command given"),
    ]
    running = [(args, text, subprocess.Popen([sys.executable, "-m", "isolators", *args], cwd=ROOT, text=True,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE))
               for args, text in [*cases, (("exec", f"--socket={nowhere}", "--gpus", "1", "--", "true"), None)]]
    for args, text, process in running:
        _, stderr = process.communicate(timeout=60)
        if text is None:  # nothing listens there: the command never runs
            assert process.returncode == 125
            assert stderr.startswith(f"gpu-isolator exec: error: cannot reach the gpu-isolator service at {nowhere}:"
                                     " No such file or directory (is 'gpu-isolator serve' running?")
            assert stderr.count("\n") == 1
            continue
        assert process.returncode == 2, (args, stderr)
        assert text in stderr and stderr.count("\n") == 1, (args, stderr)


def test_serve_stops_on_sigterm_and_tells_whoever_waits(serve_factory) -> None:
    service = serve_factory("memory").start()
    with connect(service) as holder, connect(service) as waiter:
        assert holder.ask("prepare", {"container_id": "all", "gpus": 4}).body["error"] is None
        waiter.on_queued = lambda body: None
        waiter.send("prepare", {"request": "b", "container_id": "b", "gpus": 1, "wait": True})
        service.wait_state(lambda s: len(s["waiting"]) == 1)
        assert service.stop() == 0
        assert waiter.receive(10).body["error"] == "the gpu-isolator service is stopping; ask again once it runs"
