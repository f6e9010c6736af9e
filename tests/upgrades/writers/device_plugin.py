"""Upgrade fixture: what the device plugin keeps once it allocated GPUs to pods and a rolling update stopped it.

Run by ``python -m tests.upgrades.write_fixtures device_plugin`` with the
earlier release's code (see ``write_fixtures``). On one simulated 8-GPU
node (``DGX8``) with a node ledger, that release's ``kubelet-plugin``
answers the kubelet's ``Allocate`` for pod ``p1`` (gpu-0) and ``p2``
(gpu-1 and gpu-2), which PodResources then lists, and for pod ``gone``
(gpu-3), which ends (PodResources no longer lists it); once its ledger
holds exactly the two pods' units it gets SIGTERM. ``_kube_node.kept``
copies what it left: the node's CDI spec, the ledger, and what
PodResources listed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.support.kube_node import KubeNode
from tests.support.kubelet import DGX8, plugin_directory
from tests.support.ledger import leases

from _kube_node import kept

OWNER = "kubelet-plugin:nvidia.com/gpu"
WANTED = {"195:0": (OWNER, ("ns/p1/gpu",)), "195:1": (OWNER, ("ns/p2/gpu",)), "195:2": (OWNER, ("ns/p2/gpu",))}


def main(out: Path) -> None:
    with plugin_directory() as sockets:
        kube = KubeNode(out / "run", sockets, DGX8, str(out / "run" / "ledger-dir"))
        try:
            kube.start(dra=False)
            uuid = kube.uuids
            kube.allocate("p1", [uuid["gpu-0"]])
            kube.allocate("p2", [uuid["gpu-1"], uuid["gpu-2"]])
            kube.allocate("gone", [uuid["gpu-3"]])
            kube.remove_pod("gone")
            deadline = time.monotonic() + 20
            while leases(kube.ledger) != WANTED:
                assert time.monotonic() < deadline, f"the ledger never held only the pods' units: {leases(kube.ledger)}"
                time.sleep(0.05)
        finally:
            kube.close()  # SIGTERM, as a rolling update stops it
    kept(kube, out)
    import shutil
    shutil.rmtree(out / "run")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
