"""The check on a machine with a real NVIDIA GPU and driver (no fakes).

Rules:
- Run as root on a GPU host from a source checkout:
  ``python -m tests.real_gpu.check --out DIR``. It changes no GPU setting
  for good (MIG mode included): it reads NVML, creates cgroups under roots
  of its own (``gpu-isolator-gpucheck*``) and removes them again; the MPS
  check sets GPU 0 EXCLUSIVE_PROCESS while its daemon runs and DEFAULT
  after, and runs only when GPU 0 is DEFAULT to begin with.
- Each check prints ``PASS`` or ``FAIL`` with what it saw; the exit status
  is the number of failures (0: all passed). ``DIR`` receives
  ``summary.json``, the CDI spec and the isolator's log.
- What it checks: the real NVML discovery (``inspect`` lists the GPUs
  ``nvidia-smi -L`` lists); a container granted 1 GPU sees exactly that one
  in ``nvidia-smi -L`` from inside its cgroup, a container granted 0 sees
  none, and shrinking the first to 0 takes it away; health events are
  registered on the real driver (per type, R-HE-2) and no GPU is reported
  unhealthy; usage readings come from the driver; ``cdi generate`` on the
  real node; ``serve`` + ``exec --gpus 1 / 0`` with ``nvidia-smi -L``;
  MPS (R-MP-7, where ``nvidia-cuda-mps-control`` is installed): the front
  door's daemon on GPU 0 (``actors.mps``), two clients (CUDA's driver API
  through ctypes, ``MPS_CLIENT``) at once, each allocating within its
  share's limit succeeds and past it fails, and the compute mode is
  EXCLUSIVE_PROCESS while the daemon runs and DEFAULT after (the daemon's
  answers to its get_* commands are recorded, for the stand-in). Not yet run
  on a GPU: written when no GPU was lent (issue 49).
- Every subprocess and every isolator call is bounded (a hang fails).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

RESULTS: list[dict[str, Any]] = []
LD_CACHE = "/etc/ld.so.cache"  # or one built by loader_cache() when the system's lacks the driver
BACKEND = "auto"  # --device-backend
DEV_DIR = "/dev"  # --dev-dir: only a dry run elsewhere (fake NVML, mknod'd nodes) changes it
TIMEOUT = 60.0


def check(name: str, ok: bool, seen: Any) -> bool:
    RESULTS.append({"check": name, "ok": bool(ok), "seen": seen})
    print(f"{'PASS' if ok else 'FAIL'} {name}: {str(seen)[:700]}", flush=True)
    return bool(ok)


def sh(argv: list[str], timeout: float = TIMEOUT, **kwargs: Any) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(argv, 124, exc.stdout or "", f"timed out after {timeout}s")
    except OSError as exc:
        return subprocess.CompletedProcess(argv, 127, "", str(exc))


def gpu_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("GPU ")]


def in_cgroup(cgroup_dir: str, argv: list[str]) -> subprocess.CompletedProcess:
    """Run argv as a child placed in cgroup_dir before it executes."""
    def enter() -> None:
        with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
    return sh(argv, preexec_fn=enter)


def facts() -> dict[str, Any]:
    seen: dict[str, Any] = {}
    seen["uname"] = os.uname().release
    seen["nvidia-smi -L"] = sh(["nvidia-smi", "-L"]).stdout.strip()
    seen["dev"] = sorted(name for name in os.listdir(DEV_DIR) if name.startswith("nvidia"))
    seen["cgroup2 at /sys/fs/cgroup"] = os.path.isfile("/sys/fs/cgroup/cgroup.controllers")
    seen["v1 devices"] = os.path.isfile("/sys/fs/cgroup/devices/devices.allow")
    seen["self cgroup"] = open("/proc/self/cgroup").read().strip()
    import pynvml
    pynvml.nvmlInit()
    try:
        seen["driver"] = pynvml.nvmlSystemGetDriverVersion()
        count = pynvml.nvmlDeviceGetCount()
        seen["nvml count"] = count
        for index in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpu: dict[str, Any] = {"uuid": pynvml.nvmlDeviceGetUUID(handle), "minor": pynvml.nvmlDeviceGetMinorNumber(handle)}
            try:
                gpu["mig mode (current, pending)"] = pynvml.nvmlDeviceGetMigMode(handle)
            except pynvml.NVMLError as exc:
                gpu["mig mode"] = str(exc)
            try:
                gpu["supported event types"] = hex(pynvml.nvmlDeviceGetSupportedEventTypes(handle))
            except pynvml.NVMLError as exc:
                gpu["supported event types"] = str(exc)
            seen[f"gpu {index}"] = gpu
        seen["libnvidia-ml"] = next((line.split()[-1] for line in open("/proc/self/maps")
                                     if "libnvidia-ml" in line), None)
    finally:
        pynvml.nvmlShutdown()
    print(json.dumps(seen, indent=1), flush=True)
    return seen


def loader_cache(seen: dict[str, Any]) -> None:
    """Use the system's loader cache when it lists the driver's NVML, else build one (ldconfig -C)."""
    global LD_CACHE
    listed = sh(["ldconfig", "-p"]).stdout
    seen["ld.so.cache lists libnvidia-ml"] = "libnvidia-ml.so.1" in listed
    if "libnvidia-ml.so.1" in listed or not seen.get("libnvidia-ml"):
        return
    libdir = os.path.dirname(seen["libnvidia-ml"])
    os.makedirs("/tmp/gpucheck", exist_ok=True)
    built = sh(["ldconfig", "-C", "/tmp/gpucheck/ld.so.cache", "-f", "/dev/null", libdir])
    LD_CACHE = "/tmp/gpucheck/ld.so.cache"
    seen["built loader cache"] = {"dir": libdir, "rc": built.returncode, "stderr": built.stderr[-300:]}
    print(f"the system's loader cache does not list libnvidia-ml.so.1: using {LD_CACHE} of {libdir}", flush=True)


def check_inspect(uuids: list[str]) -> None:
    run = sh([sys.executable, "-m", "isolators", "inspect"])
    check("inspect lists the GPUs nvidia-smi lists (real NVML)",
          run.returncode == 0 and all(uuid in run.stdout for uuid in uuids),
          {"rc": run.returncode, "stdout": run.stdout[-1500:], "stderr": run.stderr[-500:]})


def check_cdi(out: str, uuids: list[str]) -> None:
    path = os.path.join(out, "cdi.json")
    run = sh([sys.executable, "-m", "isolators", "cdi", "generate", "--volume-dir", "/tmp/gpucheck/cdi-volume",
              "--ld-cache", LD_CACHE, "--dev-dir", DEV_DIR, "--output", path])
    spec: dict[str, Any] = {}
    if run.returncode == 0:
        with open(path) as handle:
            spec = json.load(handle)
    names = [device.get("name") for device in spec.get("devices", [])]
    nodes = [node.get("hostPath") or node.get("path") for device in spec.get("devices", []) for node in
             device.get("containerEdits", {}).get("deviceNodes", [])]
    check("cdi generate on the real node",
          run.returncode == 0 and spec.get("kind") == "nvidia.com/gpu" and "all" in names
          and all(uuid in names for uuid in uuids) and all(os.path.exists(node) for node in nodes),
          {"rc": run.returncode, "stderr": run.stderr[-800:], "kind": spec.get("kind"), "devices": names,
           "device nodes": sorted(set(nodes)),
           "shared mounts": len(spec.get("containerEdits", {}).get("mounts", []))})


async def check_isolator(out: str, uuids: list[str]) -> None:
    from actors.nvml import NvmlService, register_health_events
    from isolators import ContainerConfig, ContainerID, Flags, NvidiaComponents, NvidiaGpuIsolatorProcess, Resources
    from runtime import Runtime

    base = "/tmp/gpucheck/api"
    flags = Flags(runtime_dir=f"{base}/run", work_dir=f"{base}/work", volume_dir=f"{base}/volume",
                  node_ledger=f"{base}/ledger",
                  cgroups_root="gpu-isolator-gpucheck", ld_cache=LD_CACHE, dev_dir=DEV_DIR,
                  device_backend=BACKEND)
    async with Runtime():
        components = await asyncio.wait_for(NvidiaComponents.create(flags), TIMEOUT)
        try:
            isolator = await asyncio.wait_for(NvidiaGpuIsolatorProcess.create(flags, components), TIMEOUT)
            await asyncio.wait_for(isolator.recover([], set()), TIMEOUT)
            state = await components.allocator.state()
            total = sorted(g.minor for g in components.allocator.total())
            check("the allocator manages the GPUs NVML reports, each watched for health",
                  len(total) == len(uuids) and not state.unwatched,
                  {"minors": total, "unwatched": sorted(g.minor for g in state.unwatched),
                   "a container's cgroup": isolator.devices.path("probe")})

            one, none = ContainerID("gpucheck-one"), ContainerID("gpucheck-none")
            info = await asyncio.wait_for(isolator.prepare(one, ContainerConfig(resources=Resources.parse("gpus:1"))), TIMEOUT)
            await asyncio.wait_for(isolator.prepare(none, ContainerConfig(resources=Resources.parse("gpus:0;cpus:1"))), TIMEOUT)
            one_dir, none_dir = isolator.devices.path(one.value), isolator.devices.path(none.value)
            seen_one = in_cgroup(one_dir, ["nvidia-smi", "-L"])
            seen_none = in_cgroup(none_dir, ["nvidia-smi", "-L"])
            check("a container granted 1 GPU sees exactly one in nvidia-smi -L",
                  len(gpu_lines(seen_one.stdout)) == 1 and uuids[0] in seen_one.stdout if len(uuids) == 1
                  else len(gpu_lines(seen_one.stdout)) == 1,
                  {"cgroup": one_dir, "rc": seen_one.returncode, "stdout": seen_one.stdout.strip(),
                   "stderr": seen_one.stderr.strip()[-300:],
                   "grant": msgspec_to_builtins(info.grant) if info is not None else None})
            check("a container granted 0 GPUs sees none in nvidia-smi -L",
                  not gpu_lines(seen_none.stdout),
                  {"cgroup": none_dir, "rc": seen_none.returncode, "stdout": seen_none.stdout.strip(),
                   "stderr": seen_none.stderr.strip()[-300:]})

            check_cuda(one_dir, none_dir)
            usage = await asyncio.wait_for(isolator.usage(one), TIMEOUT)
            smi = sh(["nvidia-smi", "--query-gpu=uuid,memory.total,memory.used,power.draw,temperature.gpu,"
                      "utilization.gpu", "--format=csv,noheader,nounits"]).stdout.strip()
            gpus = [msgspec_to_builtins(stat) for stat in (usage.gpus or [])]
            check("usage readings come from the driver",
                  len(gpus) == 1 and all(stat.get("memory_total_bytes", 0) > 0 for stat in gpus),
                  {"usage": gpus, "nvidia-smi": smi})

            await asyncio.wait_for(isolator.update(one, Resources.parse("gpus:0")), TIMEOUT)
            shrunk = in_cgroup(one_dir, ["nvidia-smi", "-L"])
            check("after update to gpus:0 the container sees none",
                  not gpu_lines(shrunk.stdout),
                  {"rc": shrunk.returncode, "stdout": shrunk.stdout.strip(), "stderr": shrunk.stderr.strip()[-300:]})

            unhealthy = await components.allocator.unhealthy()
            check("no GPU reported unhealthy by the real driver's events",
                  not unhealthy, {str(g.minor): reason for g, reason in unhealthy.items()})
            await asyncio.wait_for(isolator.cleanup(one), TIMEOUT)
            await asyncio.wait_for(isolator.cleanup(none), TIMEOUT)
            available = sorted(g.minor for g in await components.allocator.available())
            check("cleanup returns the GPUs and removes the cgroups",
                  available == total and not os.path.exists(one_dir) and not os.path.exists(none_dir),
                  {"available": available})
        finally:
            await components.close()

    # Per-type registration on the driver, read directly (R-HE-2).
    service = await NvmlService.open(None)
    try:
        nvml = service.nvml
        event_set = nvml.event_set_create()
        try:
            registration = register_health_events(nvml, event_set, range(len(uuids)))
        finally:
            nvml.event_set_free(event_set)
        check("health events registered per type on the real driver",
              bool(registration.registered) and not registration.unknown,
              {"registered": registration.registered, "unknown": registration.unknown})
    finally:
        await service.close()


CUDA_PROBE = ("import torch\n"
              "n = torch.cuda.device_count()\n"
              "x = torch.ones(1 << 20, device='cuda') if n else None\n"
              "print('cuda devices', n, 'sum', float(x.sum()) if n else None)\n")


def check_cuda(one_dir: str, none_dir: str) -> None:
    """A CUDA program (PyTorch, where the host has it) in each container: it
    needs the control devices and nvidia-uvm too, which nvidia-smi does not."""
    if sh([sys.executable, "-c", "import torch"]).returncode != 0:
        print("SKIP CUDA programs in the containers: PyTorch is not installed here", flush=True)
        return
    one = in_cgroup(one_dir, [sys.executable, "-c", CUDA_PROBE])
    none = in_cgroup(none_dir, [sys.executable, "-c", CUDA_PROBE])
    check("a CUDA program granted 1 GPU allocates on it; granted 0 sees no device",
          "cuda devices 1 sum 1048576.0" in one.stdout and "cuda devices 1" not in none.stdout,
          {"granted 1": [one.returncode, one.stdout.strip(), one.stderr.strip()[-300:]],
           "granted 0": [none.returncode, none.stdout.strip(), none.stderr.strip()[-300:]]})


MPS_CLIENT = r"""
import ctypes, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
def call(name, *args):
    return getattr(cuda, name)(*args)
device, context, within, past = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_uint64()
codes = [call("cuInit", 0), call("cuDeviceGet", ctypes.byref(device), 0),
         call("cuCtxCreate_v2", ctypes.byref(context), 0, device)]
codes.append(call("cuMemAlloc_v2", ctypes.byref(within), ctypes.c_size_t(int(sys.argv[1]))))
print("within", codes[-1], flush=True)
time.sleep(float(sys.argv[3]))  # both clients hold their memory at once
codes.append(call("cuMemAlloc_v2", ctypes.byref(past), ctypes.c_size_t(int(sys.argv[2]))))
print("past", codes[-1], flush=True)
print("codes", codes, flush=True)
"""
"""One MPS client: CUDA's driver API through ctypes (no toolkit needed), allocating
``argv[1]`` bytes (within its limit), holding them ``argv[3]`` s, then ``argv[2]`` more
(past it). It prints each result code (0: CUDA_SUCCESS, 2: CUDA_ERROR_OUT_OF_MEMORY)."""


def check_mps(out: str, uuids: list[str]) -> None:
    """R-MP-7: limits that hold on a real GPU (see module rules)."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        print("SKIP MPS: nvidia-cuda-mps-control is not installed here", flush=True)
        return
    import pynvml
    pynvml.nvmlInit()
    try:
        before = pynvml.nvmlDeviceGetComputeMode(pynvml.nvmlDeviceGetHandleByIndex(0))
    finally:
        pynvml.nvmlShutdown()
    if before != pynvml.NVML_COMPUTEMODE_DEFAULT:
        print(f"SKIP MPS: GPU 0's compute mode is {before}, not DEFAULT: this check would not restore it", flush=True)
        return
    seen = asyncio.run(_mps_clients(control, uuids[0]))
    limit, within, past = seen["limit"], seen["within"], seen["past"]
    answers = [(c.get("within"), c.get("past")) for c in seen["clients"]]
    check(f"two MPS clients of one share limited to {limit} bytes: {within} bytes each succeed, {past} more fail",
          answers == [("0", "2"), ("0", "2")], seen)
    check("the compute mode is EXCLUSIVE_PROCESS while the MPS daemon runs and DEFAULT after",
          seen["mode while"] == 3 and seen["mode after"] == 0, {k: seen[k] for k in ("mode while", "mode after")})
    with open(os.path.join(out, "mps-control.log"), "w") as handle:
        handle.write(seen.get("control.log", ""))


async def _mps_clients(control: str, uuid: str) -> dict[str, Any]:
    from actors.mps import MpsDaemons, ShareLimits
    from actors.nvml import BindingsNvml, NvmlService
    from runtime import Runtime

    limit, within, past = 2 << 30, 1 << 30, 3 << 30
    seen: dict[str, Any] = {"limit": limit, "within": within, "past": past, "clients": []}
    async with Runtime():
        nvml = BindingsNvml()
        nvml.init()
        service = NvmlService(nvml)
        shutil.rmtree("/tmp/gpucheck/mps", ignore_errors=True)
        daemons = MpsDaemons(service, "/tmp/gpucheck/mps", control, timeout_s=TIMEOUT)
        try:
            share = await daemons.share(uuid, "gpucheck", ShareLimits(memory_bytes=limit, thread_percentage=50))
            seen["mode while"] = await service.call(lambda: nvml.compute_mode(nvml.handle(0)))
            # What the real daemon answers (its formats are not documented): recorded, for the stand-in to follow.
            from actors.mps import _daemon
            seen["daemon answers"] = await service.call(lambda: {
                command: _daemon.send(control, daemons.paths(uuid), [command], TIMEOUT)
                for command in ("get_default_device_pinned_mem_limit 0", "get_default_active_thread_percentage",
                                "get_server_list")})
            env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": share.pipe_dir}
            env.pop("CUDA_VISIBLE_DEVICES", None)

            def clients() -> list[dict[str, str]]:
                running = [subprocess.Popen([sys.executable, "-c", MPS_CLIENT, str(within), str(past), "3"], env=env,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                           for _ in range(2)]
                answers = []
                for process in running:
                    try:
                        stdout, stderr = process.communicate(timeout=TIMEOUT)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        stdout, stderr = process.communicate()
                    answer = dict(line.split(" ", 1) for line in stdout.splitlines() if " " in line)
                    answers.append({**answer, "rc": str(process.returncode), "stderr": stderr[-300:]})
                return answers

            seen["clients"] = await service.call(clients)
            seen["control.log"] = open(daemons.paths(uuid).control_log).read()[-4000:]
            await daemons.release("gpucheck")
            seen["mode after"] = await service.call(lambda: nvml.compute_mode(nvml.handle(0)))
        finally:
            await daemons.close()
            await service.close()
    return seen


def msgspec_to_builtins(value: Any) -> Any:
    import msgspec
    return msgspec.to_builtins(value)


def check_serve_exec(out: str, uuids: list[str]) -> None:
    log = open(os.path.join(out, "serve.log"), "w")
    base = "/tmp/gpucheck/serve"
    server = subprocess.Popen(
        [sys.executable, "-m", "isolators", "-v", "serve", f"--socket={base}/gpu-isolator.sock", "--listen",
         "127.0.0.1:5052",
         "--cgroups_root=gpu-isolator-gpucheck-serve", f"--runtime_dir={base}/run", f"--work_dir={base}/work",
         f"--volume_dir={base}/volume", f"--ld_cache={LD_CACHE}", f"--dev_dir={DEV_DIR}",
         f"--device_backend={BACKEND}", f"--node_ledger={base}/ledger"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + TIMEOUT
        status = sh([sys.executable, "-m", "isolators", "status", f"--socket={base}/gpu-isolator.sock"])
        while status.returncode != 0 and time.monotonic() < deadline and server.poll() is None:
            time.sleep(0.5)
            status = sh([sys.executable, "-m", "isolators", "status", f"--socket={base}/gpu-isolator.sock"])
        check("serve starts and status answers", status.returncode == 0,
              {"rc": status.returncode, "stdout": status.stdout[-800:], "stderr": status.stderr[-500:]})
        one = sh([sys.executable, "-m", "isolators", "exec", f"--socket={base}/gpu-isolator.sock", "--gpus", "1", "--",
                  "nvidia-smi", "-L"])
        check("exec --gpus 1 -- nvidia-smi -L lists exactly one GPU",
              one.returncode == 0 and len(gpu_lines(one.stdout)) == 1,
              {"rc": one.returncode, "stdout": one.stdout.strip(), "stderr": one.stderr.strip()[-500:]})
        zero = sh([sys.executable, "-m", "isolators", "exec", f"--socket={base}/gpu-isolator.sock", "--gpus", "0", "--",
                   "nvidia-smi", "-L"])
        check("exec --gpus 0 -- nvidia-smi -L lists none",
              zero.returncode not in (125, 126, 127) and not gpu_lines(zero.stdout),
              {"rc": zero.returncode, "stdout": zero.stdout.strip(), "stderr": zero.stderr.strip()[-500:]})
        too_many = sh([sys.executable, "-m", "isolators", "exec", f"--socket={base}/gpu-isolator.sock", "--gpus",
                       str(len(uuids) + 1), "--", "true"])
        check("exec asking for more GPUs than the node has fails with 125",
              too_many.returncode == 125 and "only" in too_many.stderr, {"rc": too_many.returncode, "stderr": too_many.stderr.strip()[-500:]})
        metrics = sh(["python3", "-c", "import urllib.request;print(urllib.request.urlopen("
                      "'http://127.0.0.1:5052/metrics', timeout=10).read().decode())"])
        wanted = [line for line in metrics.stdout.splitlines() if line.startswith(("allocator_", "service_"))]
        check("GET /metrics answers with the allocator's gauges", metrics.returncode == 0 and bool(wanted),
              wanted[:20] or metrics.stderr[-300:])
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def leftovers() -> None:
    """No container cgroup is left; then the check's own roots are removed."""
    found, roots = [], []
    for mount in ("/sys/fs/cgroup", "/sys/fs/cgroup/devices", "/sys/fs/cgroup/unified"):
        if not os.path.isdir(mount):
            continue
        for name in os.listdir(mount):
            root = os.path.join(mount, name)
            if name.startswith("gpu-isolator-gpucheck") and os.path.isdir(root):
                roots.append(root)
                found += [os.path.join(root, child) for child in os.listdir(root)
                          if os.path.isdir(os.path.join(root, child))]
    check("no container cgroup left behind", not found, found)
    for root in roots:
        try:
            os.rmdir(root)
        except OSError as exc:
            print(f"cannot remove {root}: {exc}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/gpucheck/out")
    parser.add_argument("--dev-dir", default="/dev", help="where the nvidia* nodes are (a dry run's own)")
    parser.add_argument("--device-backend", default="auto", help="auto (the default), cgroups_v1 or cgroups_v2")
    args = parser.parse_args()
    global DEV_DIR, BACKEND
    DEV_DIR, BACKEND = args.dev_dir, args.device_backend
    os.makedirs(args.out, exist_ok=True)
    for stale in ("api", "serve", "cdi-volume"):
        shutil.rmtree(f"/tmp/gpucheck/{stale}", ignore_errors=True)
    logging.basicConfig(filename=os.path.join(args.out, "isolator.log"), level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    seen = facts()
    loader_cache(seen)
    uuids = [seen[f"gpu {index}"]["uuid"] for index in range(seen["nvml count"])]
    steps = [("inspect", lambda: check_inspect(uuids)), ("cdi", lambda: check_cdi(args.out, uuids)),
             ("isolator", lambda: asyncio.run(check_isolator(args.out, uuids))),
             ("serve", lambda: check_serve_exec(args.out, uuids)), ("mps", lambda: check_mps(args.out, uuids)),
             ("leftovers", leftovers)]
    for name, step in steps:
        try:
            step()
        except Exception as exc:  # one step failing must not hide the others
            import traceback
            traceback.print_exc()
            check(f"step {name} ran", False, repr(exc))
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump({"facts": seen, "results": RESULTS}, handle, indent=1, default=str)
    failures = sum(not result["ok"] for result in RESULTS)
    print(f"{len(RESULTS) - failures} passed, {failures} failed", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
