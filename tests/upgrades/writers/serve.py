"""Writer: what ``gpu-isolator serve`` keeps, written by the earlier release's code.

Rules (run by ``python -m tests.upgrades.write_fixtures serve``; root, cgroups v1):
- ``serve`` (the earlier release's, as a subprocess on a simulated 4-GPU
  node with a node ledger) grants two containers: ``agent-job`` (2 GPUs,
  prepared as an agent asks: no command, root's) and an exec container
  (1 GPU) running ``sleep``. Then it gets SIGTERM (what a rolling update
  sends): the records and the leases stay; the exec command's client is
  killed afterwards, which ends the command (its cgroup empties).
- Kept under the out dir: ``work/service/containers.json`` (the records),
  ``ledger/`` (``units/*.lease``, ``owners/*.owner``), ``host.json``
  (the test's node gets the same GPU UUIDs) and ``facts.json``: the
  kernel facts a test rebuilds the state from -- each container's cgroup
  ``devices.list`` lines -- the GPUs the service showed each container
  holding, the exec container's name, and ``base`` (every kept path starts
  with it: the socket, so the owner ``serve:<BASE>/run/gpu-isolator.sock``)
  and ``cgroups_root`` (the records name the root they belong to): tests
  rewrite both to their own (and name the owner files after the rewritten
  owners).
- Nothing is left on the machine: the service and its command are stopped,
  the cgroups and the scratch directory removed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

from isolators.simulated_node import remove_cgroup_tree
from tests.support.nodes import Node
from tests.support.services import ServeProcess, ask, gpus_of


def write(out: str, base: str) -> None:
    node = Node(os.path.join(base, "node"), "cgroups_v1", 4, root_prefix="gpu-isolator-fixture-",
                node_ledger=os.path.join(base, "ledger"))
    service = ServeProcess(node, os.path.join(base, "serve"))
    service.socket = os.path.join(base, "run", "gpu-isolator.sock")
    cgroups = node.root
    try:
        service.start()
        assert ask(service, "prepare", container_id="agent-job", gpus=2)["error"] is None
        command = service.exec("sleep", "1000", gpus=1)
        state = service.wait_state(lambda s: any(v["pid"] for v in s["containers"].values()))
        held = gpus_of(state)
        exec_name = next(name for name, view in state["containers"].items() if view["command"])
        kernel = {}
        for name in sorted(held):
            with open(os.path.join(cgroups, name, "devices.list")) as listed:
                kernel[name] = listed.read().split("\n")[:-1]
        assert service.stop() == 0
        command.kill()  # its supervisor ends the command
        command.wait()
        deadline = time.monotonic() + 10
        while True:
            with open(os.path.join(cgroups, exec_name, "cgroup.procs")) as procs:
                if not procs.read().split():
                    break
            assert time.monotonic() < deadline, "the exec command did not end"
            time.sleep(0.05)
        shutil.copytree(os.path.join(node.work_dir, "service"), os.path.join(out, "work", "service"))
        shutil.copytree(os.path.join(base, "ledger"), os.path.join(out, "ledger"))
        os.remove(os.path.join(out, "ledger", "lock"))  # the mutex: no content, made at open
        shutil.copy(node.host_file, os.path.join(out, "host.json"))
        facts = {"base": base, "backend": "cgroups_v1", "cgroups_root": cgroups, "socket": service.socket,
                 "owner": f"serve:{service.socket}", "containers": held, "exec": exec_name,
                 "devices_list": kernel}
        with open(os.path.join(out, "facts.json"), "w") as handle:
            json.dump(facts, handle, indent=1, sort_keys=True)
    finally:
        service.close()
        remove_cgroup_tree(cgroups)


def main() -> None:
    out = sys.argv[1]
    base = tempfile.mkdtemp(prefix="gpu-isolator-fixture-")
    os.chmod(base, 0o755)
    try:
        write(out, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
