"""A fake kubelet, and ``gpu-isolator kubelet-plugin`` as a real OS process, for tests.

Rules:
- ``FakeKubelet(directory)`` is the kubelet's side of deviceplugin v1beta1
  (grpcio's synchronous API, threads of its own): ``start()`` serves
  ``Registration`` on ``<directory>/kubelet.sock``. ``Register`` does what
  the kubelet does before it answers: it checks the version, dials the
  plugin's endpoint and calls ``GetDevicePluginOptions``; a plugin that
  cannot be dialled gets the error. ``refuse(n, text)`` refuses the next n
  registrations with ``text``. After an accepted registration it consumes
  ``ListAndWatch`` on a thread (a new registration of the resource
  replaces the old stream, as the kubelet's does), keeping every list.
- ``Waitable`` / ``MessageRecord``: what every fake peer here (this
  kubelet, the DRA one, the fake API server) shares: a
  ``threading.Condition`` notified on every change, ``_wait(ready, what,
  timeout)`` (bounded; the transcript in the ``AssertionError``) and, for
  the kubelets, the record below.
- ``messages`` records each message in order as ``(seq, who, rpc, dict)``
  (``who``: ``plugin->kubelet`` or ``kubelet->plugin``; the dict is the
  message with its proto field names, defaults left out);
  ``transcript(since)`` renders them, one per line.
- ``wait_registrations(n)`` (until n were accepted and each one's stream
  is open, so ``stream(resource)`` is the newest), ``wait_list(resource,
  predicate, after=i)`` wait (bounded; ``AssertionError`` with what came, on timeout) on a
  ``threading.Condition`` notified by every change -- never a sleep.
- ``preferred(...)``, ``allocate(...)`` drive the plugin as the kubelet
  does (one container request per call); a refusal raises the
  ``grpc.RpcError`` with its code and details.
- ``cancel_stream(resource)`` cancels the stream (the kubelet's side
  gone); ``open_stream(resource)`` starts a new one on the same endpoint.
  ``restart()`` is a kubelet restart: the server stops, the streams end,
  every socket in the directory is deleted, ``kubelet.sock`` is created
  anew.
- ``plugin_node(directory)``: the 8-GPU NVLink node (``DGX8``) simulated
  under ``directory/node`` and an empty CDI spec dir ``directory/cdi``, as
  both plugins' command tests start them.
- ``flag_args(values)``: a node's flag values (``SimulatedNode.flag_values``)
  as ``--name=value`` options; ``plugin_directory()`` a short directory for
  the sockets (a unix socket path holds 107 bytes; pytest's are long),
  removed afterwards; ``write_credential(path)`` a root-owned 0600 secret
  file (the secret is returned).
- ``PluginCommand(args, directory, env, code=, prefix=)`` runs ``python -m isolators kubelet-plugin
  ARGS`` (``COMMAND``; a subclass names another, as the DRA driver's
  ``tests.support.dra_kubelet.DraPluginCommand``) with stderr in a log
  file, from the source tree ``code`` (its working directory, first on
  its ``sys.path``: this repository unless an earlier release's tree is
  given, as the rolling update's test does; ``prefix``: an argv it is
  run under, e.g. ``tests.support.kernel.in_cgroups`` (the cgroups of a
  container of the test's own); ``_spawn``: a subclass runs it
  elsewhere, as the image's tests do in a container,
  ``tests.support.image.ImagePluginCommand``); ``start()`` waits (bounded)
  for its first stdout line (holding
  ``READY``: ``offering ...``; the metrics address when it listens); ``wait_log(text)`` waits (bounded) for a log line;
  ``stop(signal)`` sends it and returns the exit status, killing after a
  bound; ``close()`` kills what is left.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import grpc
from google.protobuf.json_format import MessageToDict

from isolators.kubernetes import unix_target
from isolators.kubernetes._api import pb, rpc
from isolators.kubernetes.device_plugin import KUBELET_SOCKET, VERSION

from .services import ROOT, read_line

DGX8 = ROOT / "tests" / "inventory" / "data" / "dgx8-nvlink.toml"
"""The 8-GPU node (two NVLink islands of four) the plugins' command tests simulate."""


def plugin_node(directory: Path) -> tuple[Any, Path]:
    """The simulated ``DGX8`` node's files under ``directory/node`` and an empty ``directory/cdi`` (see rules)."""
    from isolators.simulated_node import SimulatedNode

    node = SimulatedNode(directory / "node", host=DGX8).create_files()
    cdi = directory / "cdi"
    cdi.mkdir()
    return node, cdi

PLUGIN_TO_KUBELET = "plugin->kubelet"
KUBELET_TO_PLUGIN = "kubelet->plugin"
WAIT = 20.0  # seconds: the bound of every wait (a hang fails, it does not stall CI)


def flag_args(values: Mapping[str, Any]) -> list[str]:
    """``--name=value`` for each flag (None left out, lists comma-joined)."""
    args = []
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, (list, tuple)):
            value = ",".join(str(item) for item in value)
        args.append(f"--{name}={value}")
    return args


@contextmanager
def plugin_directory() -> Iterator[Path]:
    """A short directory under /tmp for the kubelet's and the plugin's sockets."""
    directory = Path(tempfile.mkdtemp(prefix="k8s-", dir="/tmp"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def write_credential(path: str | os.PathLike[str]) -> str:
    """A bearer secret in ``path``, mode 0600 (owned by whoever runs the tests: root in CI)."""
    secret = secrets.token_hex(16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secret + "\n")
    return secret


class Stream:
    """One ``ListAndWatch`` stream the fake kubelet consumes."""

    def __init__(self, resource: str, call: Any) -> None:
        self.resource = resource
        self.call = call
        self.lists: list[list[tuple[str, str, list[int]]]] = []
        self.ended: str | None = None
        """Why it ended (the status code's name), None while it runs."""


class Waitable:
    """A fake peer whose state tests wait for (see module rules)."""

    SEEN = "messages"  # what ``transcript`` shows, named in a timeout's error

    def __init__(self) -> None:
        self._changed = threading.Condition()

    def transcript(self, since: int = 0) -> str:
        raise NotImplementedError

    def _wait(self, ready: Callable[[], Any], what: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                value = ready()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{what} did not happen within {timeout}s; {self.SEEN}:\n{self.transcript()}")
                self._changed.wait(left)


class MessageRecord(Waitable):
    """A fake kubelet's record of the messages both ways (see module rules)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[tuple[int, str, str, dict]] = []

    @staticmethod
    def as_record(message: Any) -> dict:
        """A message as it is recorded (a subclass may show it otherwise)."""
        return _as_dict(message)

    def record(self, who: str, method: str, message: Any) -> None:
        with self._changed:
            self.messages.append((len(self.messages), who, method, self.as_record(message)))
            self._changed.notify_all()

    def transcript(self, since: int = 0) -> str:
        return "\n".join(f"{seq:3d} {who:16s} {method}: {json.dumps(body, sort_keys=True)}"
                         for seq, who, method, body in self.messages[since:])


class FakeKubelet(MessageRecord):
    """The kubelet's side of the device plugin API (see module rules)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__()
        self.directory = Path(directory)
        self.socket = self.directory / KUBELET_SOCKET
        self.registrations: list[dict] = []
        self.streams: dict[str, list[Stream]] = {}
        self.endpoints: dict[str, str] = {}
        self._server: grpc.Server | None = None
        self._channels: dict[str, grpc.Channel] = {}
        self._refusals: list[str] = []

    # -- the kubelet's server ------------------------------------------------------------
    def start(self) -> "FakeKubelet":
        server = grpc.server(ThreadPoolExecutor(4, thread_name_prefix="fake-kubelet"))
        rpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(unix_target(str(self.socket)))
        server.start()
        self._server = server
        return self

    def refuse(self, count: int, text: str) -> None:
        """Refuse the next ``count`` registrations with ``text``."""
        with self._changed:
            self._refusals += [text] * count

    def restart(self) -> None:
        """A kubelet restart: stop, streams end, every socket deleted, ``kubelet.sock`` anew."""
        self._stop_server()
        for name in os.listdir(self.directory):
            path = self.directory / name
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                path.unlink()
        self.start()

    def close(self) -> None:
        self._stop_server()

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait(WAIT)
            self._server = None
        for streams in self.streams.values():
            for stream in streams:
                stream.call.cancel()
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    # -- records --------------------------------------------------------------------------
    def wait_registrations(self, count: int, timeout: float = WAIT) -> list[dict]:
        """The registrations once ``count`` were accepted and each one's stream is open."""
        def done() -> Any:
            accepted = self.registrations[:count]
            return self.registrations[:] if len(accepted) == count and all("stream" in r for r in accepted) else None

        return self._wait(done, f"{count} registrations", timeout)

    def stream(self, resource: str) -> Stream:
        return self.streams[resource][-1]

    def wait_list(self, resource: str, predicate: Callable[[list], bool] = lambda devices: True, *,
                  after: int = 0, timeout: float = WAIT) -> tuple[int, list[tuple[str, str, list[int]]]]:
        """The first list of the current stream of ``resource`` at index >= ``after`` for which ``predicate`` holds."""
        def found() -> Any:
            streams = self.streams.get(resource)
            if not streams:
                return None
            lists = streams[-1].lists
            for index in range(after, len(lists)):
                if predicate(lists[index]):
                    return (index, lists[index])
            return None

        return self._wait(found, f"a matching ListAndWatch list of {resource} (after {after})", timeout)

    def wait_stream_end(self, stream: Stream, timeout: float = WAIT) -> str:
        return self._wait(lambda: stream.ended, f"the end of a {stream.resource} stream", timeout)

    # -- the kubelet's calls --------------------------------------------------------------
    def stub(self, resource: str) -> Any:
        channel = self._channels.get(resource)
        if channel is None:
            channel = self._channels[resource] = grpc.insecure_channel(
                unix_target(str(self.directory / self.endpoints[resource])))
        return rpc.DevicePluginStub(channel)

    def open_stream(self, resource: str, registration: dict | None = None) -> Stream:
        request = pb.Empty()
        self.record(KUBELET_TO_PLUGIN, "ListAndWatch", request)
        stream = Stream(resource, self.stub(resource).ListAndWatch(request))
        with self._changed:
            self.streams.setdefault(resource, []).append(stream)
            if registration is not None:
                registration["stream"] = stream
            self._changed.notify_all()
        threading.Thread(target=self._consume, args=(stream,), name=f"fake-kubelet-{resource}", daemon=True).start()
        return stream

    def cancel_stream(self, resource: str) -> Stream:
        stream = self.stream(resource)
        stream.call.cancel()
        self.wait_stream_end(stream)
        return stream

    def _consume(self, stream: Stream) -> None:
        try:
            for response in stream.call:
                self.record(PLUGIN_TO_KUBELET, "ListAndWatch", response)
                devices = [(d.ID, d.health, [n.ID for n in d.topology.nodes]) for d in response.devices]
                with self._changed:
                    stream.lists.append(devices)
                    self._changed.notify_all()
            ended = "OK"
        except grpc.RpcError as error:
            ended = error.code().name
        with self._changed:
            stream.ended = ended
            self._changed.notify_all()

    def preferred(self, resource: str, available: list[str], must_include: list[str], size: int) -> list[str]:
        request = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size)])
        self.record(KUBELET_TO_PLUGIN, "GetPreferredAllocation", request)
        response = self.stub(resource).GetPreferredAllocation(request, timeout=WAIT)
        self.record(PLUGIN_TO_KUBELET, "GetPreferredAllocation", response)
        return list(response.container_responses[0].deviceIDs)

    def allocate(self, resource: str, ids: list[str]) -> Any:
        """The ``ContainerAllocateResponse`` for one container request."""
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        self.record(KUBELET_TO_PLUGIN, "Allocate", request)
        response = self.stub(resource).Allocate(request, timeout=WAIT)
        self.record(PLUGIN_TO_KUBELET, "Allocate", response)
        return response.container_responses[0]


def _as_dict(message: Any) -> dict:
    """A message as a dict with its proto field names (zero values shown: NUMA node 0 is a fact)."""
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


class _Registration(rpc.RegistrationServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self.kubelet = kubelet

    def Register(self, request: Any, context: Any) -> Any:
        kubelet = self.kubelet
        kubelet.record(PLUGIN_TO_KUBELET, "Register", request)
        with kubelet._changed:
            refusal = kubelet._refusals.pop(0) if kubelet._refusals else None
        if refusal is not None:
            kubelet.record(KUBELET_TO_PLUGIN, "Register (refused)", pb.Empty())
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        if request.version != VERSION:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version!r}")
        endpoint = kubelet.directory / request.endpoint
        asked = pb.Empty()
        kubelet.record(KUBELET_TO_PLUGIN, "GetDevicePluginOptions", asked)
        try:
            with grpc.insecure_channel(unix_target(str(endpoint))) as channel:
                options = rpc.DevicePluginStub(channel).GetDevicePluginOptions(asked, timeout=5)
        except grpc.RpcError as error:
            context.abort(grpc.StatusCode.UNKNOWN, f"cannot dial the plugin at {endpoint}: {error.details()}")
        kubelet.record(PLUGIN_TO_KUBELET, "GetDevicePluginOptions", options)
        with kubelet._changed:
            old = kubelet._channels.pop(request.resource_name, None)
            kubelet.endpoints[request.resource_name] = request.endpoint
        if old is not None:
            for stream in kubelet.streams.get(request.resource_name, []):
                stream.call.cancel()
            old.close()
        answer = pb.Empty()
        kubelet.record(KUBELET_TO_PLUGIN, "Register (accepted)", answer)
        registration = {
            "resource": request.resource_name, "endpoint": request.endpoint, "version": request.version,
            "options": _as_dict(request.options), "dialled_options": _as_dict(options), "at": time.monotonic(),
        }
        with kubelet._changed:
            kubelet.registrations.append(registration)
            kubelet._changed.notify_all()
        threading.Thread(target=kubelet.open_stream, args=(request.resource_name, registration), daemon=True).start()
        return answer


class PluginCommand:
    """``gpu-isolator kubelet-plugin`` as a real process (see module rules)."""

    COMMAND = "kubelet-plugin"
    READY = "offering "
    """What its first stdout line holds once it serves."""

    def __init__(self, args: list[str], directory: str | os.PathLike[str], env: dict[str, str] | None = None, *,
                 code: str | os.PathLike[str] | None = None, prefix: Sequence[str] = ()) -> None:
        self.args = list(args)
        self.prefix = list(prefix)
        self.code = Path(code) if code is not None else ROOT
        self.directory = Path(directory)
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None
        self.first_line = ""
        self.address: str | None = None
        self._log_path = self.directory / f"{self.COMMAND}-{id(self)}.log"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout: float = 60.0) -> "PluginCommand":
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "ab") as log:
            self.process = self._spawn(log)
        line = read_line(self.process.stdout, timeout).decode()
        if self.READY not in line:
            try:
                code = self.process.wait(5) if not line else self.process.poll()  # stdout closed: it exited
            except subprocess.TimeoutExpired:
                code = None
            self.close()
            raise AssertionError(f"{self.COMMAND} did not start (exit {code}; waited at most {timeout}s):"
                                 f" {line!r}\n{self.log()}")
        self.first_line = line.strip()
        if "metrics at http://" in line:
            self.address = line.split("metrics at http://", 1)[1].split("/", 1)[0]
        return self

    def _spawn(self, log: Any) -> subprocess.Popen:
        """The command's process, stdout a pipe and stderr ``log`` (a subclass runs it elsewhere: in a container)."""
        return subprocess.Popen([*self.prefix, sys.executable, "-m", "isolators", self.COMMAND, *self.args],
                                cwd=self.code,
                                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=self.env)

    def log(self) -> str:
        try:
            return self._log_path.read_text()
        except OSError:
            return ""

    def wait_log(self, text: str, timeout: float = WAIT, count: int = 1) -> str:
        """Wait until ``text`` appears ``count`` times in the log (the file grows as the plugin logs)."""
        deadline = time.monotonic() + timeout
        while self.log().count(text) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not logged {count}x within {timeout}s:\n{self.log()[-4000:]}")
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"kubelet-plugin exited ({self.process.returncode}):\n{self.log()[-4000:]}")
            time.sleep(0.05)
        return self.log()

    def stop(self, signo: int = signal.SIGTERM, timeout: float = WAIT) -> int | None:
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
                raise AssertionError(f"kubelet-plugin did not stop within {timeout}s\n{self.log()[-4000:]}") from None
        process.stdout.close()
        self.process = None
        return process.returncode

    def close(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            self.process.stdout.close()
            self.process = None

    # -- its HTTP side ---------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """``GET /metrics``, parsed by prometheus-client: {sample name: value}."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=10) as response:
            text = response.read().decode()
        return {sample.name: sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples if not sample.labels}

    def post(self, path: str, body: Any, token: str | None = None, method: str = "POST") -> tuple[int, str]:
        """One request to the plugin's HTTP side: (status, body text)."""
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(f"http://{self.address}{path}", data=data if method == "POST" else None,
                                         headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()
