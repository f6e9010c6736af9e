"""Real engines consume the isolator's grant (R-CD-1, R-CD-3, R-CD-5): for a
0-, 1- and 2-GPU container and after an update, ``podman run --runtime runc
--device <cdi name>`` with the transient spec the isolator wrote, and runc
with ``runc spec`` merged with ``to_oci()``.

The node's dev dir holds mknod'd nodes (no driver behind them) and is also
bind-mounted at ``/host-dev``: the container sees its GPU nodes and the
control devices, opening them gives ENXIO (allowed; no driver), a GPU it was
not granted is absent from ``/dev`` and gives EPERM through ``/host-dev``,
and ``NVIDIA_VISIBLE_DEVICES`` holds exactly its GPUs' UUIDs.
"""

from __future__ import annotations

import pytest

import runtime
from isolators import ContainerConfig, ContainerID, Resources
from tests.support.containers import config
from tests.support.engines import make_device_nodes, parse_probe

from .conftest import CONTROL_NODES, GPU_NODES
from .test_engines_static_spec import assert_sees_exactly, probe_args


@pytest.mark.asyncio
async def test_podman_and_runc_run_exactly_the_grant(podman, runc, busybox_rootfs, node_factory, tmp_path) -> None:
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    node = node_factory("memory", gpus=4, cdi_spec_dir=str(cdi_dir))
    make_device_nodes(node.dev_dir, {**GPU_NODES, **CONTROL_NODES})
    host_dev = f"{node.dev_dir}:/host-dev:dev"

    def run_both(info, minors: list[int], uuid_of: dict[int, str]) -> None:
        (device,) = info.cdi_devices
        result = podman.run(podman.image, probe_args(), devices=[device], volumes=[host_dev], cdi_dir=str(cdi_dir))
        assert result.returncode == 0, result.stderr
        by_podman = parse_probe(result.stdout)
        assert_sees_exactly(by_podman, minors)
        result = runc.run(busybox_rootfs, info.to_oci(), probe_args(), binds={"/host-dev": node.dev_dir})
        assert result.returncode == 0, result.stderr
        by_runc = parse_probe(result.stdout)
        assert_sees_exactly(by_runc, minors)
        visible = ",".join(uuid_of[m] for m in minors) or "none"
        assert by_podman.env["NVIDIA_VISIBLE_DEVICES"] == by_runc.env["NVIDIA_VISIBLE_DEVICES"] == visible

    async with runtime.Runtime():
        components, isolator = await node.start()
        uuid_of = {info.gpu.minor: info.uuid for info in components.inventory.gpus}
        infos = {}
        for name, gpus in (("c0", 0), ("c1", 1), ("c2", 2)):
            infos[name] = await isolator.prepare(ContainerID(name), config(gpus))
        held = await isolator.containers()
        assert held == {"c0": [], "c1": [0], "c2": [1, 2]}
        for name in ("c0", "c1", "c2"):
            run_both(infos[name], held[name], uuid_of)
        await isolator.update(ContainerID("c1"), Resources.parse("gpus:2"))
        assert (await isolator.containers())["c1"] == [0, 3]
        # a container started now gets the grant as it is after the update: podman reads
        # the rewritten spec; runc gets to_oci() of a nested container's launch info
        nested = await isolator.prepare(ContainerID("task", ContainerID("c1")), ContainerConfig())
        run_both(nested, [0, 3], uuid_of)
        await isolator.cleanup(ContainerID("task", ContainerID("c1")))
        for name in ("c0", "c1", "c2"):
            await isolator.cleanup(ContainerID(name))
        assert list(cdi_dir.iterdir()) == []
