"""Child process: the MIG kernel scenario on the real pynvml bindings over the
fake NVML (``tests.support.mig.kernel_scenario``).

Usage: python mig_kernel_probe.py LIBNVIDIA_ML_PATH < jobs.json > results.json

Each job: ``config`` (the fake NVML's config), ``flags`` (the node's flags:
no host file, so NVML is the fake library), ``dev_dir`` (the mknod'ed nodes,
``tests.support.mig.mknod_mig_nodes``). The answer is what the scenario saw,
or ``{"error": ...}``.
"""

from __future__ import annotations

import asyncio
import os

from tests.support.nvml_probe import error_of, serve


def run_job(job: dict) -> dict:
    from actors.flags import Flags
    from runtime import Runtime
    from tests.support.mig import kernel_scenario, mig_nodes_in

    os.environ["FAKE_NVML_CONFIG"] = job["config"]
    os.environ["FAKE_NVML_FAIL"] = ""

    async def scenario() -> dict:
        async with Runtime():
            return await kernel_scenario(Flags.from_dict(job["flags"]), mig_nodes_in(job["dev_dir"]))

    try:
        return asyncio.run(scenario())
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return error_of(exc)


if __name__ == "__main__":
    serve(run_job)
