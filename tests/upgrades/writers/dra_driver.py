"""Upgrade fixture: what the DRA driver keeps once it prepared claims and a rolling update stopped it.

Run by ``python -m tests.upgrades.write_fixtures dra_driver`` with the
earlier release's code (see ``write_fixtures``). On one simulated 8-GPU
node (``DGX8``) with a node ledger, that release's ``dra-plugin`` (and its
device plugin, idle) prepares three claims the fake API server allocated
-- ``one`` (gpu-0), ``two`` (gpu-1 and gpu-2), ``gone`` (gpu-3, then
unprepared and deleted, as a pod that ended) -- then every plugin gets
SIGTERM. ``_kube_node.kept`` copies what it left: the checkpoint, the
claims' CDI specs, the ledger, and the API server's ResourceClaims.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.support.kube_node import NAMESPACE, KubeNode
from tests.support.kube_api import allocation_result
from tests.support.kubelet import DGX8, plugin_directory
from tests.support.ledger import leases

from _kube_node import kept

DRIVER = "gpu.isolator.dev"
NODE = "node-a"
CLAIMS = {"one": ["gpu-0"], "two": ["gpu-1", "gpu-2"], "gone": ["gpu-3"]}


def main(out: Path) -> None:
    with plugin_directory() as sockets:
        kube = KubeNode(out / "run", sockets, DGX8, str(out / "run" / "ledger-dir"))
        try:
            kube.start()
            refs = {}
            for index, (name, devices) in enumerate(CLAIMS.items()):
                uid = f"0000000{index + 1}-0100-4000-8000-00000000000{index + 1}"
                kube.api.add_claim(NAMESPACE, name, [allocation_result("gpus", DRIVER, NODE, device)
                                                     for device in devices], uid=uid)
                refs[name] = (NAMESPACE, name, uid)
                answer = kube.prepare(refs[name])
                assert [d["device_name"] for d in answer["devices"]] == devices, answer
            assert kube.unprepare(refs["gone"]) == {}
            kube.api.remove_claim(NAMESPACE, "gone")
            deadline = time.monotonic() + 20  # the ledger link returns gpu-3 after its linger
            while sorted(leases(kube.ledger)) != ["195:0", "195:1", "195:2"]:
                assert time.monotonic() < deadline, f"gpu-3 never went back: {leases(kube.ledger)}"
                time.sleep(0.05)
            assert sorted(kube.prepared()) == sorted(refs[n][2] for n in ("one", "two"))
        finally:
            kube.close()  # SIGTERM to both plugins, as a rolling update stops them
    kept(kube, out)
    import shutil
    shutil.rmtree(out / "run")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
