"""Child process for the fake-NVML tests: the real pynvml over the fake library.

Usage: python nvml_probe.py LIBNVIDIA_ML_PATH < jobs.json > results.json

The fake library is loaded with RTLD_GLOBAL first, so pynvml's
CDLL("libnvidia-ml.so.1") finds it by soname. Each job sets FAKE_NVML_CONFIG
/ FAKE_NVML_FAIL and runs against ``BindingsNvml``; results are JSON
(msgspec builtins), errors as {"error": {type, message, function, code}}.
Jobs ("op"): "inventory" (inventory, usage, health-event registration), "uninitialized"
(a call before nvmlInit), "resources" (NvidiaGpuAllocator.resources with
host_file None), "allocate" (create an allocator on the bindings and
allocate counts in order), "mig_usage" (the readings of every MIG device), "events"
(register every GPU on an event set, append the job's "raise" lines to
$FAKE_NVML_EVENTS, wait for each event), "compute_mode" (``compute_steps``
on the bindings with $FAKE_NVML_STATE set to the job's "state").
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import sys
from typing import Callable

import msgspec


def error_of(exc: BaseException) -> dict:
    return {
        "error": {
            "type": type(exc).__name__,
            "message": str(exc),
            "function": getattr(exc, "function", None),
            "code": getattr(exc, "code", None),
        }
    }


def run_job(job: dict) -> dict:
    from actors import NvidiaGpuAllocator
    from actors.flags import Flags
    from actors.nvml import BindingsNvml, read_inventory, read_mig_usage, read_usage, register_health_events
    from runtime import Runtime

    if job.get("config"):
        os.environ["FAKE_NVML_CONFIG"] = job["config"]
    else:
        os.environ.pop("FAKE_NVML_CONFIG", None)
    os.environ["FAKE_NVML_FAIL"] = job.get("fail", "")
    if job.get("events"):
        os.environ["FAKE_NVML_EVENTS"] = job["events"]
    if job.get("state"):
        os.environ["FAKE_NVML_STATE"] = job["state"]
    else:
        os.environ.pop("FAKE_NVML_STATE", None)
    op = job["op"]
    nvml = BindingsNvml()
    try:
        if op == "uninitialized":
            return {"count": nvml.device_count()}
        if op == "resources":
            flags = Flags.from_dict(job["flags"])
            return {"resources": str(NvidiaGpuAllocator.resources(flags))}
        nvml.init()
        try:
            if job.get("fail_after_init"):
                os.environ["FAKE_NVML_FAIL"] = job["fail_after_init"]
            if op == "inventory":
                inventory = read_inventory(nvml)
                usage = read_usage(nvml, [(g.index, g.gpu) for g in inventory.gpus])
                event_set = nvml.event_set_create()
                registration = register_health_events(nvml, event_set, range(len(inventory.gpus)))
                nvml.event_set_free(event_set)
                return msgspec.to_builtins({"inventory": inventory, "usage": usage, "health": registration})
            if op == "mig_usage":
                inventory = read_inventory(nvml)
                targets = [(m.parent_index, m.index, m.device) for m in inventory.mig_devices]
                return msgspec.to_builtins({"mig_usage": read_mig_usage(nvml, targets)})
            if op == "events":
                event_set = nvml.event_set_create()
                register_health_events(nvml, event_set, range(nvml.device_count()))
                with open(job["events"], "a") as events:
                    events.write("".join(line + "\n" for line in job["raise"]))
                seen = []
                while (event := nvml.event_set_wait(event_set, 0.5)) is not None:
                    seen.append(event)
                nvml.event_set_free(event_set)
                return {"events": msgspec.to_builtins(seen)}
            if op == "compute_mode":
                return {"steps": compute_steps(nvml, job["steps"])}
            if op == "allocate":
                async def allocate() -> list:
                    picks = []
                    async with Runtime():
                        flags = Flags.from_dict(job.get("flags", {}))
                        allocator = await NvidiaGpuAllocator.create(flags, nvml_resources(flags), nvml)
                        for count in job["counts"]:
                            picks.append(sorted(g.minor for g in await allocator.allocate(count)))
                        await allocator.close()
                    return picks

                def nvml_resources(flags):
                    return NvidiaGpuAllocator.resources(flags, nvml)

                return {"picks": asyncio.run(allocate())}
            raise ValueError(f"unknown op {op!r}")
        finally:
            os.environ["FAKE_NVML_FAIL"] = ""
            nvml.close()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return error_of(exc)


def compute_steps(nvml, steps: list) -> list:
    """Each step ``[target, mode]`` (target: a GPU index, or ``[gpu, mig index]``;
    mode None: read only) sets then reads the target's compute mode; a step
    ``"reopen"`` shuts NVML down and inits it again. One answer per step: the
    mode read, or the error. The simulated node runs the same steps."""
    answers = []
    for step in steps:
        if step == "reopen":
            nvml.shutdown()
            nvml.init()
            answers.append("reopened")
            continue
        target, mode = step
        try:
            handle = nvml.handle(target) if isinstance(target, int) else nvml.mig_device_handle(
                nvml.handle(target[0]), target[1])
            if mode is not None:
                nvml.set_compute_mode(handle, mode)
            answers.append(nvml.compute_mode(handle))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            answers.append(error_of(exc))
    return answers


def serve(run: Callable[[dict], dict]) -> None:
    """Load the fake (argv[1]) before pynvml does, run each job of stdin, answer JSON."""
    ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
    jobs = json.loads(sys.stdin.read())
    json.dump([run(job) for job in jobs], sys.stdout)


if __name__ == "__main__":
    serve(run_job)
