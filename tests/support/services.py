"""``gpu-isolator serve``, ``exec`` and ``status`` as real OS processes, for tests.

Rules:
- ``ServeProcess(node, directory, **options)`` runs ``python -m isolators
  serve`` on a test node's flags (written to a flags file) with its unix
  socket in a directory of its own that every user may traverse
  (``tests.support.users.public_dir``), and, with ``listen``, on TCP too
  (``credential``: the bearer secret, written to a root-owned 0600 file).
  ``start()`` waits (bounded) for its "serving on" line. ``stop()`` sends
  SIGTERM and waits (bounded), then kills; its exit status is returned.
  ``restart()`` is stop and start with the same socket and address. Its
  log (stderr) is kept in a file and shown by ``log()``.
- ``state()`` is the state as root reads it on the socket (as a plain
  JSON document); ``wait_state(pred)`` polls it until ``pred(state)``
  holds, failing with the last state after ``timeout`` seconds;
  ``state_naming(*probes)`` waits until it names each probe's process.
  ``metrics()`` is the parsed ``GET /metrics`` (TCP: ``listen`` needed).
- ``exec(...)`` starts ``gpu-isolator exec --socket <socket> ...`` with
  pipes, as root or, with ``user``, as that throwaway user
  (``tests.support.users``); ``finish(process)`` waits for it (bounded)
  and returns (status, stdout, stderr). ``status(*args, user=None)`` runs
  ``gpu-isolator status``.
- ``probe(*paths, ...)`` execs ``exec_probe`` (``tests/native/exec_probe.c``,
  built once per session with gcc into a public directory: any user can
  run it): it opens every path it is given (``O_RDWR``; ``r:/path``:
  ``O_RDONLY``, reported as ``/path``) and prints one JSON line -- errno
  per path (0 = opened), its pid, parent, uids, gid, groups, NoNewPrivs,
  ``/proc/self/cgroup``, working directory and the visible-devices
  variables -- then, with ``hold``, waits until its stdin closes; it exits
  with ``code`` (``serve``: it opens each path it reads on stdin and
  prints its errno, until stdin closes). ``probe_result`` adds ``access``: the verdict on each
  path (``probes.verdict``: GRANTED or DENIED), which tests compare.
- Every process started is killed by ``close()`` (the fixtures call it),
  and the socket's directory removed.
- ``connect(service)`` is a ``SocketClient`` of this (root) process;
  ``ask(service, verb, **body)`` one request on a connection of its own,
  the answer's body; ``tcp_message(service, name, body, sender, secret)``
  a libprocess message over TCP (with the bearer ``secret`` or without),
  its HTTP status and text.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import msgspec

from isolators.service import SocketClient, fetch_state
from isolators.service._launcher import read_line as read_fd_line

from .probes import verdicts
from .users import ThrowawayUser, public_dir

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "tests" / "native"
_built: dict[str, str] = {}


def native_tool(name: str) -> str:
    """``tests/native/<name>.c`` built once per session into a public directory (its path); gcc needed."""
    if name not in _built:
        if shutil.which("gcc") is None:
            import pytest

            pytest.skip("needs gcc to build the exec probe")
        if "" not in _built:
            _built[""] = public_dir("gpu-isolator-tools-")
        directory = _built[""]
        target = os.path.join(directory, name)
        subprocess.run(["gcc", "-O1", "-o", target, str(NATIVE / f"{name}.c")], check=True, capture_output=True)
        os.chmod(target, 0o755)
        _built[name] = target
    return _built[name]


def remove_native_tools() -> None:
    directory = _built.pop("", None)
    _built.clear()
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def communicate(process: subprocess.Popen, timeout: float, late: str) -> tuple[Any, Any]:
    """``process``'s whole output, once it ends within ``timeout`` seconds;
    otherwise it is killed and the test fails: ``<late> within <timeout>s:
    <its stderr>``."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _out, err = process.communicate()
        err = err.decode() if isinstance(err, bytes) else err
        raise AssertionError(f"{late} within {timeout}s: {err}") from None


def read_line(stream: Any, timeout: float) -> bytes:
    """One line from a pipe, or what came before ``timeout`` / end of stream."""
    return read_fd_line(stream.fileno(), timeout)


class ServeProcess:
    """``gpu-isolator serve`` for one test (see module rules)."""

    def __init__(self, node: Any, directory: str | os.PathLike[str], listen: str | None = None,
                 poll_interval: float = 0.1, credential: str | None = None, confine: tuple[str, ...] = (),
                 options: tuple[str, ...] = (), **flags: Any) -> None:
        self.node = node
        self.directory = Path(directory)
        self.listen = listen
        self.poll_interval = poll_interval
        self.credential = credential
        self.confine = confine
        self.options = options
        self.flags = flags
        self.process: subprocess.Popen | None = None
        self.public = public_dir("gpu-isolator-serve-")
        self.socket = os.path.join(self.public, "run", "gpu-isolator.sock")
        self.address = ""
        self.ready_line = ""
        self.children: list[subprocess.Popen] = []
        self._log_path = self.directory / f"serve-{id(self)}.log"

    # -- the service ---------------------------------------------------------------------
    def command(self) -> list[str]:
        flags_file = self.directory / "flags.json"
        flags_file.write_text(json.dumps(self.node.flag_values(self.flags)))
        argv = [sys.executable, "-m", "isolators", "serve", f"--socket={self.socket}", "--flags", str(flags_file),
                "--poll-interval", str(self.poll_interval), *[f"--confine={path}" for path in self.confine],
                *self.options]
        if self.listen is not None:
            argv.append(f"--listen={self.listen}")
        if self.credential is not None:
            secret = self.directory / "credential"
            secret.write_text(self.credential + "\n")
            os.chmod(secret, 0o600)
            argv.append(f"--credential={secret}")
        return argv

    def start(self, timeout: float = 60.0) -> "ServeProcess":
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), cwd=ROOT, stdout=subprocess.PIPE, stderr=log,
                                            stdin=subprocess.DEVNULL)
        line = read_line(self.process.stdout, timeout).decode()
        if "serving on " not in line:
            self.stop()
            raise AssertionError(f"serve did not start within {timeout}s: {line!r}\n{self.log()}")
        self.ready_line = line.strip()
        if " and as gpu-isolator@" in line:
            self.address = line.split(" and as gpu-isolator@", 1)[1].split()[0]
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
        """Stop (SIGTERM) and start again on the same socket and address; the stop's exit status."""
        code = self.stop()
        if self.address:
            self.listen = self.address
        self.start(timeout)
        return code

    def log(self) -> str:
        try:
            return self._log_path.read_text()[-6000:]
        except OSError:
            return ""

    def state(self) -> dict[str, Any]:
        """The state as root reads it on the socket."""
        return msgspec.to_builtins(fetch_state(self.socket))

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

    def state_naming(self, *probes: dict[str, Any], timeout: float = 15.0) -> dict[str, Any]:
        """The state once it names every probe's process as a container's pid
        (the service records a command's pid when its supervisor reports it,
        which may be after the command printed)."""
        pids = {probe["pid"] for probe in probes}
        return self.wait_state(lambda s: pids <= {view["pid"] for view in s["containers"].values()}, timeout)

    # -- clients -------------------------------------------------------------------------------
    def _cli(self, args: list[str], user: ThrowawayUser | None, **popen: Any) -> subprocess.Popen:
        if user is None:
            return subprocess.Popen([sys.executable, "-m", "isolators", *args], **{"cwd": ROOT, **popen})
        return user.cli(*args, **{"cwd": self.public, **popen})

    def exec(self, *command: str, gpus: int | None = None, mig: tuple[str, ...] | list[str] = (), wait: bool = False,
             stdin: Any = subprocess.PIPE, user: ThrowawayUser | None = None, **popen: Any) -> subprocess.Popen:
        """``gpu-isolator exec`` (``--gpus`` when given, one ``--mig`` per entry of ``mig``)."""
        options = [f"--socket={self.socket}", *(["--gpus", str(gpus)] if gpus is not None else [])]
        options += [f"--mig={profile}" for profile in mig] + (["--wait"] if wait else [])
        process = self._cli(["exec", *options, "--", *command], user, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **popen)
        self.children.append(process)
        return process

    def probe(self, *paths: str, gpus: int | None = None, mig: tuple[str, ...] | list[str] = (), hold: bool = False,
              serve: bool = False, wait: bool = False, code: int = 0, user: ThrowawayUser | None = None,
              **popen: Any) -> subprocess.Popen:
        args = [*paths, *(["--hold"] if hold else []), *(["--serve"] if serve else []), "--exit", str(code)]
        return self.exec(native_tool("exec_probe"), *args, gpus=gpus, mig=mig, wait=wait, user=user, **popen)

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
        out, err = communicate(process, timeout, "exec did not end")
        return process.returncode, out.decode(), err.decode()

    def status(self, *args: str, timeout: float = 30.0, user: ThrowawayUser | None = None,
               socket: str | None = None) -> subprocess.CompletedProcess:
        process = self._cli(["status", f"--socket={socket or self.socket}", *args], user, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
        self.children.append(process)
        out, err = communicate(process, timeout, "status did not answer")
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

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
        shutil.rmtree(self.public, ignore_errors=True)


def gpus_of(state: dict[str, Any]) -> dict[str, list[int]]:
    """Container -> minors, from a state document."""
    return {name: view["gpus"] for name, view in state["containers"].items()}


def connect(service: ServeProcess) -> SocketClient:
    """A connection of this test's process (root) to the service's socket."""
    return SocketClient.connect(service.socket, timeout=20)


def ask(service: ServeProcess, verb: str, timeout: float = 20.0, **body: Any) -> dict[str, Any]:
    """One request on a connection of its own; the answer's body (``verb`` checked by the caller)."""
    with connect(service) as client:
        return client.ask(verb, body, timeout=timeout).body


def tcp_message(service: ServeProcess, name: str, body: dict[str, Any], sender: str,
                secret: str | None = None) -> tuple[int, str]:
    """A libprocess message to ``gpu-isolator`` over TCP (``secret``: as the bearer); (status, text)."""
    import http.client

    host, port = service.address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    headers = {"Libprocess-From": sender, **({"Authorization": f"Bearer {secret}"} if secret else {})}
    try:
        connection.request("POST", f"/gpu-isolator/{name}", body=json.dumps(body), headers=headers)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()
