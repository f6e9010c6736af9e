"""The raw-kernel floor: the cgroup work of container churn done directly.

Rules:
- One synchronous loop, no isolator, no event loop: each round does one
  lifecycle per worker slot, the same mix as the workers (slots below
  ``GPUS`` hold one GPU), until ``seconds`` have passed.
- v1 (``floor_v1``): mkdir, ``a`` to devices.deny, each allow rule of the
  container's policy (standard set, control devices, its GPU) to
  devices.allow, the GPU's deny (what update(gpus:0) writes), rmdir; one
  open fd per file, one ``write(2)`` per rule.
- v2 (``floor_v2``): mkdir, load the policy's program (the verifier
  included), attach it, for a GPU container load and attach (replace) the
  gpus:0 program, rmdir; ``cached``: every program loaded once up front,
  each lifecycle only attaching.
- Its CPU time is measured as the isolator's is (``ChurnRun.cpu``): all of
  it is the loop's thread, syscalls included.
- Cgroups are made under ``<hierarchy>/<cgroups_root>`` (created if
  missing; the caller removes it).
"""

from __future__ import annotations

import os
import time
from typing import Callable

from actors import NVIDIA_MAJOR
from actors.devices import (
    Policy,
    DeviceRule,
    bpf,
    build_device_program,
    container_policy,
    plan_writes,
    v1_exceptions,
)

from .cpu import CpuClock
from .workload import GPUS, ChurnRun

Progress = Callable[[float, int], None]


def _policy(control: list[DeviceRule], gpu_minor: int | None) -> Policy:
    gpus = [DeviceRule("c", NVIDIA_MAJOR, gpu_minor, "rwm")] if gpu_minor is not None else []
    allow, deny = container_policy(control, gpus)
    return Policy.create(allow, deny)


def _timed_loop(body: Callable[[int], None], workers: int, seconds: float, progress: Progress | None) -> ChurnRun:
    run = ChurnRun()
    clock = time.perf_counter
    cpu_start = CpuClock.read()
    start = clock()
    deadline = start + seconds
    i = 0
    while clock() < deadline:
        for _ in range(workers):  # one round: the same GPU / CPU-only mix as the workers
            body(i)
            i += 1
        if progress is not None:
            progress((clock() - start) / seconds, i)
    run.elapsed = clock() - start
    run.cpu = CpuClock.read().since(cpu_start)
    run.lifecycles = i
    return run


def floor_v1(hierarchy: str, cgroups_root: str, control: list[DeviceRule], workers: int,
             seconds: float, progress: Progress | None = None) -> ChurnRun:
    """The cgroups v1 floor (see module rules)."""
    root = os.path.join(hierarchy, cgroups_root)
    os.makedirs(root, exist_ok=True)
    gpu_workers = min(GPUS, workers)
    plans = []
    for slot in range(workers):
        minor = slot if slot < gpu_workers else None
        writes = plan_writes(None, v1_exceptions(_policy(control, minor)))
        deny_all = [line.encode() for name, line in writes if name == "devices.deny"]
        allows = [line.encode() for name, line in writes if name == "devices.allow"]
        revoke = f"c {NVIDIA_MAJOR}:{minor} rwm".encode() if minor is not None else None
        plans.append((deny_all, allows, revoke))
    mkdir, rmdir, open_, write, close = os.mkdir, os.rmdir, os.open, os.write, os.close
    flags = os.O_WRONLY | os.O_CLOEXEC

    def lifecycle(i: int) -> None:
        deny_all, allows, revoke = plans[i % workers]
        path = f"{root}/floor-{i}"
        mkdir(path)
        deny = open_(path + "/devices.deny", flags)
        allow = open_(path + "/devices.allow", flags)
        for line in deny_all:
            write(deny, line)
        for line in allows:
            write(allow, line)
        if revoke is not None:
            write(deny, revoke)
        close(allow)
        close(deny)
        rmdir(path)

    return _timed_loop(lifecycle, workers, seconds, progress)


def floor_v2(hierarchy: str, cgroups_root: str, control: list[DeviceRule], workers: int,
             seconds: float, progress: Progress | None = None, cached: bool = False) -> ChurnRun:
    """The cgroups v2 floor (see module rules)."""
    root = os.path.join(hierarchy, cgroups_root)
    os.makedirs(root, exist_ok=True)
    gpu_workers = min(GPUS, workers)
    name = "gpuiso_floor"
    plain = build_device_program(_policy(control, None))
    codes = [build_device_program(_policy(control, slot)) if slot < gpu_workers else None
             for slot in range(workers)]
    loaded: dict[bytes, int] = {}
    if cached:
        for code in [plain, *[c for c in codes if c is not None]]:
            loaded[code] = bpf.prog_load(code, name)
    mkdir, rmdir, open_, close = os.mkdir, os.rmdir, os.open, os.close
    load, attach = bpf.prog_load, bpf.prog_attach
    multi, replace = bpf.BPF_F_ALLOW_MULTI, bpf.BPF_F_ALLOW_MULTI | bpf.BPF_F_REPLACE
    dir_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC

    def lifecycle(i: int) -> None:
        code = codes[i % workers]
        path = f"{root}/floor-{i}"
        mkdir(path)
        cgroup = open_(path, dir_flags)
        try:
            if cached:
                first = loaded[code if code is not None else plain]
                attach(cgroup, first, multi)
                if code is not None:
                    attach(cgroup, loaded[plain], replace, first)
            else:
                first = load(code if code is not None else plain, name)
                try:
                    attach(cgroup, first, multi)
                    if code is not None:
                        second = load(plain, name)
                        try:
                            attach(cgroup, second, replace, first)
                        finally:
                            close(second)
                finally:
                    close(first)
        finally:
            close(cgroup)
        rmdir(path)

    try:
        return _timed_loop(lifecycle, workers, seconds, progress)
    finally:
        for fd in loaded.values():
            close(fd)
