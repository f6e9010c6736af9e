"""``gpu-isolator serve`` and ``exec`` as real OS processes, for tests.

Rules:
- ``ServeProcess(node)`` runs ``python -m isolators serve`` on a test
  node's flags (written to a flags file), listening on loopback (port 0
  unless given); ``start()`` waits (bounded) for its "serving as" line and
  reads its address from it. ``stop()`` sends SIGTERM and waits (bounded),
  then kills; its exit status is returned. ``restart()`` is stop and start
  at the same address. Its log (stderr) is kept in a file and shown by
  ``log()``.
- ``state()`` is ``GET /gpu-isolator/state`` (JSON), ``metrics()`` the
  parsed ``GET /metrics``; ``wait_state(pred)``
  polls it until ``pred(state)`` holds, failing with the last state after
  ``timeout`` seconds.
- ``exec(...)`` starts ``python -m isolators exec --agent <address> ...``
  with pipes; ``finish(process)`` waits for it (bounded) and returns
  (status, stdout, stderr). ``status()`` runs ``python -m isolators status``.
- ``EXEC_PROBE`` is a command for exec: it opens every path it is given
  (``O_RDWR``; ``r:/path``: ``O_RDONLY``, reported as ``/path``, for
  capability nodes, which are read-only) and prints one JSON line -- errno per path (0 = opened), the
  visible-devices variables, its pid and ``/proc/self/cgroup`` -- then, with
  ``--hold``, waits until its stdin closes; it exits with ``--exit N``.
  ``probe_result`` adds ``access``: the verdict on each path
  (``probes.verdict``: GRANTED or DENIED), which tests compare.
- Every process started is killed by ``close()`` (the fixtures call it).
- ``async with client_of(service) as client``: a ``ServiceClient`` in a
  runtime of this test's own, listening on loopback; ``await ask(client,
  name, body)`` sends one request and returns its answer (bounded).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import anyio

from isolators.service import ServiceClient
from runtime import PID, Runtime, dispatch, spawn

from .probes import verdicts

ROOT = Path(__file__).resolve().parents[2]

EXEC_PROBE = r"""
import json, os, sys
args = sys.argv[1:]
hold = "--hold" in args
code = 0
if "--exit" in args:
    code = int(args[args.index("--exit") + 1])
paths = [a for a in args if a.startswith(("/", "r:/"))]
seen = {}
for arg in paths:
    path = arg[2:] if arg.startswith("r:") else arg
    try:
        os.close(os.open(path, os.O_RDONLY if arg.startswith("r:") else os.O_RDWR))
        seen[path] = 0
    except OSError as error:
        seen[path] = error.errno
with open("/proc/self/cgroup") as f:
    cgroup = f.read()
print(json.dumps({"open": seen, "pid": os.getpid(), "cgroup": cgroup,
                  "NVIDIA_VISIBLE_DEVICES": os.environ.get("NVIDIA_VISIBLE_DEVICES"),
                  "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}), flush=True)
if hold:
    sys.stdin.read()
sys.exit(code)
"""


def read_line(stream: Any, timeout: float) -> bytes:
    """One line from a pipe, or what came before ``timeout`` / end of stream."""
    deadline = time.monotonic() + timeout
    data = b""
    fd = stream.fileno()
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 1)
        if not chunk:
            break
        data += chunk
    return data


class ServeProcess:
    """``gpu-isolator serve`` for one test (see module rules)."""

    def __init__(self, node: Any, directory: str | os.PathLike[str], listen: str = "127.0.0.1:0",
                 poll_interval: float = 0.1, **flags: Any) -> None:
        self.node = node
        self.directory = Path(directory)
        self.listen = listen
        self.poll_interval = poll_interval
        self.flags = flags
        self.process: subprocess.Popen | None = None
        self.address = ""
        self.ready_line = ""
        self.children: list[subprocess.Popen] = []
        self._log_path = self.directory / f"serve-{id(self)}.log"

    # -- the service ---------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> "ServeProcess":
        self.directory.mkdir(parents=True, exist_ok=True)
        flags_file = self.directory / "flags.json"
        flags_file.write_text(json.dumps(self.node.flag_values(self.flags)))
        with open(self._log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "isolators", "serve", "--listen", self.listen, "--flags", str(flags_file),
                 "--poll-interval", str(self.poll_interval)],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
            )
        line = read_line(self.process.stdout, timeout).decode()
        if "serving as " not in line:
            self.stop()
            raise AssertionError(f"serve did not start within {timeout}s: {line!r}\n{self.log()}")
        self.ready_line = line.strip()
        pid = line.split("serving as ", 1)[1].split()[0]
        self.address = pid.split("@", 1)[1]
        return self

    def stop(self, signo: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signo)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise AssertionError(f"serve did not stop within {timeout}s of {signal.Signals(signo).name}\n"
                                     f"{self.log()}") from None
        if process.stdout is not None:
            process.stdout.close()
        self.process = None
        return process.returncode

    def restart(self, timeout: float = 60.0) -> int | None:
        """Stop (SIGTERM) and start again at the same address; the stop's exit status."""
        code = self.stop()
        self.listen = self.address
        self.start(timeout)
        return code

    def log(self) -> str:
        try:
            return self._log_path.read_text()[-6000:]
        except OSError:
            return ""

    def state(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{self.address}/gpu-isolator/state", timeout=10) as response:
            return json.loads(response.read())

    def metrics(self) -> dict[str, float]:
        """``GET /metrics``, parsed by prometheus-client: {sample name: value} (unlabelled samples)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=10) as response:
            text = response.read().decode()
        return {sample.name: sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples if not sample.labels}

    def wait_state(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 15.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            if predicate(state):
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"state never matched within {timeout}s: {state}\n{self.log()}")
            time.sleep(0.05)

    # -- clients -------------------------------------------------------------------------------
    def exec(self, *command: str, gpus: int | None = None, mig: tuple[str, ...] | list[str] = (), wait: bool = False,
             stdin: Any = subprocess.PIPE) -> subprocess.Popen:
        """``gpu-isolator exec`` (``--gpus`` when given, one ``--mig`` per entry of ``mig``)."""
        options = ["--agent", self.address, *(["--gpus", str(gpus)] if gpus is not None else [])]
        options += [f"--mig={profile}" for profile in mig] + (["--wait"] if wait else [])
        process = subprocess.Popen([sys.executable, "-m", "isolators", "exec", *options, "--", *command],
                                   cwd=ROOT, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.children.append(process)
        return process

    def probe(self, *paths: str, gpus: int | None = None, mig: tuple[str, ...] | list[str] = (), hold: bool = False,
              wait: bool = False, code: int = 0) -> subprocess.Popen:
        probe = self.directory / "exec_probe.py"
        if not probe.exists():
            probe.write_text(EXEC_PROBE)
        args = [*paths, *(["--hold"] if hold else []), "--exit", str(code)]
        return self.exec(sys.executable, "-I", "-S", str(probe), *args, gpus=gpus, mig=mig, wait=wait)

    @staticmethod
    def probe_result(process: subprocess.Popen, timeout: float = 30.0) -> dict[str, Any]:
        """The probe's JSON line (read while it holds)."""
        line = read_line(process.stdout, timeout)
        if not line:
            stderr = process.stderr.read().decode() if process.poll() is not None else ""
            raise AssertionError(f"no answer from the probe within {timeout}s (exit {process.poll()}): {stderr}")
        result = json.loads(line)
        result["access"] = verdicts(result["open"])
        return result

    @staticmethod
    def finish(process: subprocess.Popen, timeout: float = 30.0) -> tuple[int, str, str]:
        if process.stdin is not None and process.stdin.closed:
            process.stdin = None  # closed by the test (the command's end of input)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            raise AssertionError(f"exec did not end within {timeout}s: {err.decode()}") from None
        return process.returncode, out.decode(), err.decode()

    def status(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "isolators", "status", "--agent", self.address, *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)

    def close(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
            child.wait()
            for stream in (child.stdin, child.stdout, child.stderr):
                if stream is not None:
                    stream.close()
        self.children.clear()
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()
        self.process = None


def gpus_of(state: dict[str, Any]) -> dict[str, list[int]]:
    """Container -> minors, from a state document."""
    return {name: view["gpus"] for name, view in state["containers"].items()}


@asynccontextmanager
async def client_of(service: ServeProcess, id: str = "test-client") -> AsyncIterator[ServiceClient]:
    """A ServiceClient of the service, in a runtime of its own (see module rules)."""
    async with Runtime(listen="127.0.0.1:0"):
        client = ServiceClient(PID.parse(f"gpu-isolator@{service.address}"), id=id)
        spawn(client)
        yield client


async def ask(client: ServiceClient, name: str, body: Any, timeout: float = 20.0) -> Any:
    """One request and its answer."""
    with anyio.fail_after(timeout):
        return await dispatch(client.pid, ServiceClient.ask, name, body)
