"""Child process for the MPS test over the real pynvml and the fake NVML.

Usage: python mps_probe.py LIBNVIDIA_ML_PATH < jobs.json > results.json

Each job (see ``nvml_probe.py`` for the environment it sets) runs
``MpsDaemons`` on ``BindingsNvml``: it shares each of the job's "units"
(UUIDs) once with the job's "control" program under its "runtime_dir",
answers the daemon PIDs, then returns every share; the compute modes it
leaves are in the job's $FAKE_NVML_STATE for the test to read.
"""

from __future__ import annotations

import asyncio
import os

from nvml_probe import error_of, serve


def run_job(job: dict) -> dict:
    from actors.mps import MpsDaemons, ShareLimits
    from actors.nvml import BindingsNvml, NvmlService
    from runtime import Runtime

    os.environ["FAKE_NVML_CONFIG"] = job["config"]
    os.environ["FAKE_NVML_STATE"] = job["state"]
    os.environ["FAKE_NVML_FAIL"] = ""

    async def scenario() -> dict:
        async with Runtime():
            nvml = BindingsNvml()
            nvml.init()
            service = NvmlService(nvml)
            daemons = MpsDaemons(service, job["runtime_dir"], job["control"], timeout_s=5.0)
            pids = {}
            try:
                for n, uuid in enumerate(job["units"]):
                    await daemons.share(uuid, f"share-{n}", ShareLimits(memory_bytes=2 << 30, thread_percentage=50))
                    pids[uuid] = daemons.daemon_pid(uuid)
                for n in range(len(job["units"])):
                    await daemons.release(f"share-{n}")
            finally:
                await daemons.close()
                await service.close()
            return {"pids": pids}

    try:
        return asyncio.run(scenario())
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return error_of(exc)


if __name__ == "__main__":
    serve(run_job)
