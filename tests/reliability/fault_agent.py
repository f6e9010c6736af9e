"""The agent of the random fault run (``fault_run``): an isolator under churn.

Run as ``python -m tests.reliability.fault_agent CONFIG`` (a JSON object:
``dir``, ``backend``, ``root``, ``round``, ``workers``, ``gpu_workers``,
``known``, ``final``, ``seed``; optionally ``host``, the host file when it is
not ``<dir>/host.json``, and ``ledger``, the node ledger it shares with the
node's other front doors). It builds the node's isolator (device
worker process, the node's cgroups root and work directory), recovers the
``known`` containers, cleans them up, and then runs ``workers`` concurrent
lifecycles (prepare, sometimes a growing and a shrinking update, cleanup)
until it is killed. With ``final`` it only recovers, cleans up everything,
removes the root and reports what is left.

Every event goes to stdout as one JSON line, flushed, before the call it
announces (so a harness that freezes this process knows which calls may be
in flight): ``preparing``, ``prepared`` / ``prepare_failed``, ``update_failed``, ``cleaning``,
``cleaned`` / ``cleanup_failed``, ``hang`` (a call that did not answer
within ``HANG_BOUND`` seconds), ``ready``, ``final``.
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

import anyio

from isolators import ContainerConfig, ContainerID, ContainerState, Resources
from isolators.simulated_node import SimulatedNode
from runtime import Runtime

HANG_BOUND = 30.0
"""Seconds any isolator call may take before it counts as a hang."""


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"e": event, **fields}) + "\n")
    sys.stdout.flush()


async def call(op: str, cid: str, awaitable: Any) -> tuple[bool, Any]:
    """``(ok, value or error text)``; a call past ``HANG_BOUND`` is reported as a hang."""
    try:
        with anyio.fail_after(HANG_BOUND):
            return True, await awaitable
    except TimeoutError:
        emit("hang", op=op, c=cid)
        return False, "hang"
    except Exception as error:  # an expected outcome under faults: reported, then cleaned up
        return False, f"{type(error).__name__}: {error}"


async def cleanup(isolator: Any, cid: str) -> bool:
    emit("cleaning", c=cid)
    for _attempt in range(5):
        ok, value = await call("cleanup", cid, isolator.cleanup(ContainerID(cid)))
        if ok:
            emit("cleaned", c=cid)
            return True
        await anyio.sleep(0.05)
    emit("cleanup_failed", c=cid, error=value)
    return False


async def lifecycle(isolator: Any, cid: str, gpus: int, rng: random.Random) -> None:
    emit("preparing", c=cid, gpus=gpus)
    ok, value = await call("prepare", cid, isolator.prepare(
        ContainerID(cid), ContainerConfig(resources=Resources.parse(f"gpus:{gpus}"))))
    if ok:
        emit("prepared", c=cid)
        if gpus and rng.random() < 0.4:  # grow, then shrink back (issue 20.2: a growing update under faults)
            for count in (gpus + 1, gpus):
                ok, value = await call("update", cid, isolator.update(ContainerID(cid), Resources.parse(f"gpus:{count}")))
                if not ok:
                    emit("update_failed", c=cid, error=value)
        await anyio.sleep(rng.random() * 0.01)
    else:
        emit("prepare_failed", c=cid, error=value)
    await cleanup(isolator, cid)


async def worker(isolator: Any, config: dict[str, Any], index: int) -> None:
    rng = random.Random(f"{config['seed']}-{config['round']}-{index}")
    gpus = 1 if index < config["gpu_workers"] else 0
    n = 0
    while True:
        await lifecycle(isolator, f"r{config['round']}-w{index}-{n}", gpus, rng)
        n += 1


async def main(config: dict[str, Any]) -> None:
    extra = {"device_worker": "process"}
    if config.get("ledger"):
        extra["node_ledger"] = config["ledger"]
    host = config.get("host") or os.path.join(config["dir"], "host.json")
    node = SimulatedNode(config["dir"], config["backend"], host=host, cgroups_root=config["root"], extra=extra)
    async with Runtime():
        _components, isolator = await node.start()
        known = [ContainerState(ContainerID(c)) for c in config["known"]]
        ok, value = await call("recover", "-", isolator.recover(known, set()))
        if not ok:
            emit("recover_failed", error=value)
        recovered = sorted(await isolator.containers())
        emit("ready", agent=os.getpid(), worker=isolator.devices.worker_pid, recovered=recovered)
        async with anyio.create_task_group() as group:
            for cid in recovered:
                group.start_soon(cleanup, isolator, cid)
        if config["final"]:
            left = sorted(await isolator.containers())
            available = len(await node.components.allocator.available())
            ok, removed = await call("remove_root", "-", isolator.devices.remove_root())
            emit("final", containers=left, available=available, root_removed=ok and removed is True)
            await node.stop()
            return
        async with anyio.create_task_group() as group:
            for index in range(config["workers"]):
                group.start_soon(worker, isolator, config, index)


if __name__ == "__main__":
    anyio.run(main, json.loads(sys.argv[1]))
