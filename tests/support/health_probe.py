"""Child process for the health tests: the real pynvml over the fake NVML.

Usage: python health_probe.py LIBNVIDIA_ML_PATH < jobs.json > results.json

Served as ``nvml_probe.py`` serves its jobs (``serve``: the fake library is
loaded, RTLD_GLOBAL, before pynvml's ``nvmlInit``). Each job names a ``scenario`` and sets
FAKE_NVML_CONFIG (the node), FAKE_NVML_EVENTS (the events file the scenario
appends to while the library runs) and FAKE_NVML_FAIL; the scenario builds
the real components (``NvidiaComponents.create`` with ``host_file=None``),
raises events and reports what it observed as JSON. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

import anyio

GUARD = 10  # seconds: a hang guard


class Logs(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def flags_of(job: dict) -> Any:
    from isolators import Flags

    return Flags(host_file=None, device_backend="memory", gpu_allocation="lowest",
                 nvidia_health_wait=0.2, **job["dirs"])


def raise_event(job: dict, *fields: object) -> None:
    with open(job["events"], "a") as events:
        events.write("\t".join(str(f) for f in fields) + "\n")


def minors(gpus: Any) -> list[int]:
    return sorted(g.minor for g in gpus)


async def eventually(check: Any) -> None:
    with anyio.fail_after(GUARD):
        while not check():
            await anyio.sleep(0.005)


async def events_thread_gone() -> None:
    await eventually(lambda: not any(t.name.startswith("nvml-events") for t in threading.enumerate()))


def nvml_after_close() -> str:
    from actors.nvml import BindingsNvml, NvmlError

    try:
        return f"{BindingsNvml().device_count()} GPUs: NVML is still initialised"
    except NvmlError as exc:
        return str(exc)


async def isolator_scenario(job: dict) -> dict:
    """Xid 79 on a GPU without ECC events, Xid 13, ECC, mark_healthy."""
    from actors import Gpu
    from isolators import ContainerConfig, ContainerID, NvidiaComponents, NvidiaGpuIsolatorProcess, Resources
    from runtime import Runtime

    def gpus(text: str) -> ContainerConfig:
        return ContainerConfig(resources=Resources.parse(text))

    out: dict[str, Any] = {}
    flags = flags_of(job)
    async with Runtime():
        components = await NvidiaComponents.create(flags)
        allocator = components.allocator
        out["kind"] = components.inventory.kind
        out["unwatched"] = (await allocator.state()).unwatched
        isolator = await NvidiaGpuIsolatorProcess.create(flags, components)
        await isolator.recover([], set())
        a, b = ContainerID("a"), ContainerID("b")
        await isolator.prepare(a, gpus("gpus:1"))
        out["a"] = minors(await allocator.allocated())
        watch = isolator.watch(a)
        raise_event(job, "ecc", 0)        # GPU 0 has no ECC events: NVML never delivers it
        raise_event(job, "xid", 0, 13)    # the application's fault: ignored
        raise_event(job, "xid", 0, 79)    # fallen off the bus
        with anyio.fail_after(GUARD):
            limitation = await watch
        out["limitation"] = {"reason": limitation.reason, "message": limitation.message}
        out["unhealthy"] = {str(g): r for g, r in (await allocator.unhealthy()).items()}
        held = await allocator.allocated()
        await isolator.prepare(b, gpus("gpus:1"))
        out["b"] = minors(await allocator.allocated() - held)
        await isolator.cleanup(a)
        out["available_after_cleanup"] = minors(await allocator.available())
        await allocator.mark_healthy(Gpu(195, 0))
        out["available_after_mark_healthy"] = minors(await allocator.available())
        ecc = allocator.watch({Gpu(195, 2)})
        raise_event(job, "ecc", 2)
        with anyio.fail_after(GUARD):
            out["ecc"] = (await ecc).reason
        out["unhealthy_at_end"] = {str(g): r for g, r in (await allocator.unhealthy()).items()}
        await isolator.cleanup(b)
        await isolator.close()
        await components.close()
    await events_thread_gone()
    out["after_close"] = nvml_after_close()
    return out


async def wait_errors_scenario(job: dict) -> dict:
    """Waits that fail back off on the Clock; the fifth marks every GPU unhealthy."""
    from isolators import NvidiaComponents
    from runtime import Clock, Runtime

    logs = job["logs"]
    out: dict[str, Any] = {}

    def failures() -> list[str]:
        return [line for line in logs.lines if "Waiting for NVML health events failed" in line]

    async with Runtime():
        Clock.pause()
        components = await NvidiaComponents.create(flags_of(job))
        allocator = components.allocator
        watch = allocator.watch(await allocator.available())
        raise_event(job, "error", 999, 5)  # the next five waits fail with NVML_ERROR_UNKNOWN
        for count, backoff in enumerate([1, 2, 4, 8], start=1):
            await eventually(lambda: len(failures()) == count)
            out.setdefault("pending_while_retrying", []).append(watch.is_pending())
            Clock.advance(backoff)
        await eventually(lambda: len(failures()) == 5)
        with anyio.fail_after(GUARD):
            out["watch"] = (await watch).reason
        out["unhealthy"] = {str(g): r for g, r in (await allocator.unhealthy()).items()}
        Clock.advance(16)
        await eventually(lambda: any("received again" in line for line in logs.lines))
        out["available_after_recovery"] = minors(await allocator.available())
        out["failures"] = failures()
        out["recovered"] = [line for line in logs.lines if "received again" in line]
        await components.close()
    return out


async def no_driver_scenario(job: dict) -> dict:
    from isolators import NvidiaComponents
    from runtime import Runtime, snapshot

    async with Runtime():
        try:
            await NvidiaComponents.create(flags_of(job))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"type": type(exc).__name__, "message": str(exc),
                    "cause": type(exc.__cause__).__name__, "actors": len(snapshot())}
    return {"type": None}


async def ledger_default_scenario(job: dict) -> dict:
    """The real NVML with no --node_ledger: the ledger is on, where the environment says (SPEC R-NL-1)."""
    from isolators import ContainerConfig, ContainerID, Flags, NvidiaComponents, NvidiaGpuIsolatorProcess, Resources
    from runtime import Runtime

    os.environ["GPU_ISOLATOR_NODE_LEDGER"] = job["ledger_env"]
    dirs = {name: value for name, value in job["dirs"].items() if name != "node_ledger"}
    flags = Flags(host_file=None, device_backend="memory", gpu_allocation="lowest", nvidia_health_wait=0.2, **dirs)
    out: dict[str, Any] = {}
    async with Runtime():
        components = await NvidiaComponents.create(flags)
        isolator = await NvidiaGpuIsolatorProcess.create(flags, components)
        await isolator.recover([], set())
        await isolator.prepare(ContainerID("a"), ContainerConfig(resources=Resources.parse("gpus:1")))
        units = os.path.join(job["ledger_env"], "units")
        out["leases"] = sorted(os.listdir(units)) if os.path.isdir(units) else None
        out["state"] = {"node_ledger": (await components.allocator.state()).node_ledger,
                        "owner": (await components.allocator.state()).ledger_owner}
        out["said"] = [line for line in job["logs"].lines if line.startswith("node ledger")]
        await isolator.cleanup(ContainerID("a"))
        await isolator.close()
        await components.close()
    return out


SCENARIOS = {
    "ledger_default": ledger_default_scenario,
    "isolator": isolator_scenario,
    "wait_errors": wait_errors_scenario,
    "no_driver": no_driver_scenario,
}


def run_job(job: dict) -> dict:
    os.environ["FAKE_NVML_CONFIG"] = job["config"]
    os.environ["FAKE_NVML_EVENTS"] = job["events"]
    os.environ["FAKE_NVML_FAIL"] = job.get("fail", "")
    logs = Logs()
    logging.getLogger().addHandler(logs)
    logging.getLogger().setLevel(logging.INFO)
    try:
        return asyncio.run(SCENARIOS[job["scenario"]]({**job, "logs": logs}))
    finally:
        logging.getLogger().removeHandler(logs)


if __name__ == "__main__":
    from nvml_probe import serve  # beside this script

    serve(run_job)
