"""Pod repair's cost: one pass over N pod containers, and the kubelet plugin's CPU at rest.

``python -m benchmarks.pod_repair [--containers 100] [--passes 20] [--rest-seconds 30]``

- A pass: ``PodRepair.run_pass`` over ``--containers`` containers, each
  holding one time-sliced ID of an 8-GPU node (the GPUs' nodes plus two
  control devices), listed by ``FakePodResources`` (the official proto
  over a unix socket: the real client's ``List``) on a ``MemoryPodHost``
  (the kernel in memory, so the figure is the plugin's own work: one
  ``List``, the join, one check job, and one job per repair). Two
  figures: at rest (nothing to repair) and after every container was
  "reloaded" (N repairs). Median wall time and CPU time of ``--passes``
  passes each, with the machine's load average.
- At rest: ``gpu-isolator kubelet-plugin`` as a real process (a simulated
  4-GPU node, pod repair at its default interval, PodResources listing
  ``--containers`` containers holding its GPUs, none of which runs here:
  each pass lists them, makes sure of the ``/dev/char`` links and scans
  the kubepods roots), its user + system CPU over ``--rest-seconds`` read
  from ``/proc/<pid>/stat`` once a pass has read them.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time

import anyio
import msgspec

from actors.devices import DeviceRule
from actors.gpu import Gpu
from isolators.kubernetes.device_plugin import DeviceCatalog, OfferedDevice, ResourceOffer
from isolators.kubernetes.pod_repair import AssignedDevices, PodRepair, PodResourcesClient
from isolators.kubernetes.pod_repair.testing import FakePodResources, MemoryPodHost

from .reporting import emit, load_average, options

GPU = "nvidia.com/gpu"
CONTROL = {"/dev/nvidiactl": DeviceRule.parse("c 195:255 rwm"), "/dev/nvidia-uvm": DeviceRule.parse("c 235:0 rwm")}


def _catalog(containers: int) -> DeviceCatalog:
    replicas = -(-containers // 8)
    devices = [OfferedDevice(id=f"GPU-{gpu:08x}-0000-4000-8000-000000000000::{i}", unit=Gpu(195, gpu),
                             uuid=f"GPU-{gpu:08x}-0000-4000-8000-000000000000")
               for gpu in range(8) for i in range(replicas)]
    return DeviceCatalog([ResourceOffer(GPU, "gpus", devices)], replicas)


async def _passes(containers: int, passes: int, socket: str) -> dict[str, float]:
    catalog = _catalog(containers)
    server = FakePodResources(socket).start()
    host = MemoryPodHost()
    repair = PodRepair(catalog, PodResourcesClient(socket), host, control_devices=CONTROL, dev_dir="/dev")
    try:
        ids = [device for device in catalog.offers[0].devices][:containers]
        records = []
        for n, device in enumerate(ids):
            records.append(host.add("bench", f"pod-{n}", "cuda", repair.nodes_of([device.unit])))
        server.assignments = [AssignedDevices(namespace="bench", pod=f"pod-{n}", container="cuda", resource=GPU,
                                              ids=(device.id,)) for n, device in enumerate(ids)]
        first = await repair.run_pass()
        assert first.checked == containers and not first.repaired and not first.failed, first
        figures: dict[str, list[tuple[float, float]]] = {"rest": [], "repair": []}
        for _ in range(passes):
            for kind in ("rest", "repair"):
                if kind == "repair":
                    for record in records:
                        host.reload(record.container_id)
                wall, cpu = time.perf_counter(), time.process_time()
                result = await repair.run_pass()
                figures[kind].append((time.perf_counter() - wall, time.process_time() - cpu))
                expected = containers if kind == "repair" else 0
                assert result.checked == containers and len(result.repaired) == expected, result
        return {f"{kind}_{what}_ms": round(statistics.median(f[i] for f in values) * 1e3, 2)
                for kind, values in figures.items() for i, what in ((0, "wall"), (1, "cpu"))}
    finally:
        repair.close()
        server.close()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _at_rest(containers: int, seconds: float, directory: str) -> dict[str, float]:
    from isolators.simulated_node import SimulatedNode
    from tests.support.kubelet import PluginCommand, flag_args

    node = SimulatedNode(os.path.join(directory, "node"), gpus=4).create_files()
    os.makedirs(os.path.join(directory, "cdi"))
    socket = os.path.join(directory, "pr.sock")
    server = FakePodResources(socket).start()
    args = flag_args(node.flag_values(cdi_spec_dir=os.path.join(directory, "cdi"))) + [
        f"--device_plugin_dir={directory}", f"--pod_resources_socket={socket}"]
    plugin = PluginCommand(args, directory)
    try:
        plugin.start()
        with open(os.path.join(directory, "cdi", "gpu-isolator-node.json"), "rb") as handle:
            uuids = [d["name"] for d in msgspec.json.decode(handle.read())["devices"] if d["name"].startswith("GPU-")]
        server.assignments = [AssignedDevices(namespace="bench", pod=f"pod-{n}", container="cuda", resource=GPU,
                                              ids=(uuids[n % len(uuids)],)) for n in range(containers)]
        deadline = time.monotonic() + 30
        while server.calls < 2:  # a pass that read these assignments has begun: the plugin is warm
            if time.monotonic() > deadline:
                raise RuntimeError(f"the plugin made no second PodResources call in 30 s:\n{plugin.log()[-2000:]}")
            time.sleep(0.1)
        before, start = _cpu_seconds(plugin.pid), time.monotonic()
        time.sleep(seconds)
        used, elapsed = _cpu_seconds(plugin.pid) - before, time.monotonic() - start
        return {"rest_seconds": round(elapsed, 1), "rest_cpu_seconds": round(used, 3),
                "rest_cpu_percent": round(100 * used / elapsed, 2), "pod_resources_calls": server.calls}
    finally:
        plugin.close()
        server.close()


def main() -> None:
    parser = options("benchmarks.pod_repair", __doc__, repeat=1)
    parser.add_argument("--containers", type=int, default=100)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--rest-seconds", type=float, default=30.0)
    args = parser.parse_args()
    # 100 repair lines a pass are not the figure
    logging.getLogger("isolators.kubernetes.pod_repair").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="k8s-bench-", dir="/tmp") as directory:
        load_before = load_average()
        figures = anyio.run(_passes, args.containers, args.passes, os.path.join(directory, "bench.sock"))
        rest = _at_rest(args.containers, args.rest_seconds, directory) if args.rest_seconds > 0 else {}
    table = "\n".join([
        f"one pass over {args.containers} containers (fake PodResources, memory kernel), median of {args.passes}:",
        f"  at rest (nothing to repair): {figures['rest_wall_ms']} ms wall, {figures['rest_cpu_ms']} ms CPU",
        f"  all reloaded ({args.containers} repairs): {figures['repair_wall_ms']} ms wall,"
        f" {figures['repair_cpu_ms']} ms CPU",
    ] + ([f"plugin at rest (default 5 s interval, {args.containers} pods listed): {rest['rest_cpu_percent']}% of a"
          f" core ({rest['rest_cpu_seconds']} s CPU in {rest['rest_seconds']} s)"] if rest else []))
    emit("pod_repair", table, args.json_only, containers=args.containers, passes=args.passes,
         load_before=load_before, **figures, **rest)


if __name__ == "__main__":
    main()
