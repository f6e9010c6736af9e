"""A fake Kubernetes API server on 127.0.0.1, for the DRA driver's tests.

Rules:
- ``FakeApiServer()`` serves HTTP on ``127.0.0.1:<free port>`` (threads of
  its own; ``start()`` / ``close()``) the part of ``resource.k8s.io/v1`` a
  DRA driver uses, as JSON documents of that API: ResourceClaims
  (namespaced: ``GET`` one, ``POST`` create; ``GET`` the list of one
  namespace or of all, ``/resourceclaims``) and ResourceSlices (cluster
  scoped: ``GET`` list with ``fieldSelector`` ``spec.nodeName`` /
  ``spec.driver`` and ``labelSelector`` ``k=v``, ``POST`` create, ``GET`` /
  ``PUT`` / ``DELETE`` one). Objects get ``metadata.uid``,
  ``resourceVersion`` (one counter) and ``creationTimestamp``; a ``PUT``
  whose ``resourceVersion`` is not the stored one is ``409 Conflict``; an
  unknown object ``404 NotFound``, in the API's ``Status`` form. A
  ResourceSlice whose ``metadata.name`` is not a DNS subdomain of at most
  253 characters is ``422 Invalid`` with the API server's wording, as is
  one whose devices' capacity request policies the API server refuses
  (``dra_scheduler.capacity_errors``).
- The test sets the cluster's facts directly: ``add_claim(...)`` stores a
  ResourceClaim (with its ``status.allocation`` results), ``remove_claim``
  deletes one; ``slices(node)`` returns the stored slices.
  ``allocate(...)`` plays the scheduler: it allocates a claim from the
  stored slices as Kubernetes does, consumable capacity included
  (``dra_scheduler.allocate``), or raises ``Unschedulable``.
- A client that hangs up mid-request (a driver killed) is not printed
  as an error.
- ``delay_s`` makes every answer that late (a slow server); ``fail(n,
  code)`` answers the next n requests with that status; ``close()`` is a
  server that is down (open connections cut, new ones refused).
- ResourceSlices can be watched (``GET`` the list with ``watch=true``,
  ``fieldSelector`` as for a list): from ``resourceVersion`` on, or --
  without one -- the current slices as ``ADDED`` events first; every later
  create, replace and delete is an ``ADDED`` / ``MODIFIED`` / ``DELETED``
  event (JSON lines, chunked), until ``timeoutSeconds`` (default 1800),
  the client hangs up or the server closes. ``delete_slices(node)`` is
  what a starting kubelet does: every slice of the node deleted (events
  included).
- ``requests`` records every request as ``(seq, method, path, query,
  summary)``; ``transcript(since)`` renders them one per line;
  ``wait_for(predicate)`` waits (bounded, on a condition notified by every
  request: never a sleep) until ``predicate(self)`` holds.
- ``kubeconfig(path)`` writes a kubeconfig whose current context is this
  server (plain HTTP, no credentials).
"""

from __future__ import annotations

import datetime
import itertools
import json
import re
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from .kubelet import Waitable

GROUP = "/apis/resource.k8s.io/v1"
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")
WAIT = 20.0


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def opaque_config(driver: str, parameters: dict, *, requests: list[str] | None = None,
                  source: str = "FromClaim") -> dict:
    """One ``status.allocation.devices.config[]`` entry with opaque parameters for ``driver``."""
    entry: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": parameters}}
    if requests is not None:
        entry["requests"] = requests
    return entry


def allocation_result(request: str, driver: str, pool: str, device: str, *, admin_access: bool | None = None,
                      share_id: str | None = None) -> dict:
    """One ``status.allocation.devices.results[]`` entry."""
    result: dict[str, Any] = {"request": request, "driver": driver, "pool": pool, "device": device}
    if admin_access is not None:
        result["adminAccess"] = admin_access
    if share_id is not None:
        result["shareID"] = share_id
    return result


class FakeApiServer(Waitable):
    """The API server's resource.k8s.io/v1 side (see module rules)."""

    SEEN = "requests"

    def __init__(self) -> None:
        super().__init__()
        self.claims: dict[tuple[str, str], dict] = {}
        self.resource_slices: dict[str, dict] = {}
        self.requests: list[tuple[int, str, str, str, str]] = []
        self.events: list[tuple[int, str, dict]] = []
        """Every ResourceSlice change as (resourceVersion, ADDED / MODIFIED / DELETED, object), for watches."""
        self.delay_s = 0.0
        self._failures: list[int] = []
        self._versions = itertools.count(1)
        self._server: ThreadingHTTPServer | None = None
        self._connections: set[socket.socket] = set()
        self.address = ""

    # -- the server ---------------------------------------------------------------------
    def start(self) -> "FakeApiServer":
        server = _Server(("127.0.0.1", 0), _handler(self))
        server.daemon_threads = True
        self._server = server
        self.address = f"127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, name="fake-api-server", daemon=True).start()
        return self

    def close(self) -> None:
        """Down: no new connection is accepted and the open ones are cut."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._changed:
            connections, self._connections = list(self._connections), set()
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def kubeconfig(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://{self.address}"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "users": [{"name": "fake", "user": {}}],
        }))
        return path

    def fail(self, count: int, code: int = 503) -> None:
        with self._changed:
            self._failures += [code] * count

    # -- the cluster's facts ------------------------------------------------------------
    def _meta(self, name: str, namespace: str | None = None, uid: str | None = None) -> dict:
        meta = {"name": name, "uid": uid or str(uuid.uuid4()), "resourceVersion": str(next(self._versions)),
                "creationTimestamp": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
        if namespace is not None:
            meta["namespace"] = namespace
        return meta

    def add_claim(self, namespace: str, name: str, results: list[dict] | None, *, uid: str | None = None,
                  reserved_for: list[dict] | None = None, config: list[dict] | None = None) -> dict:
        """Store a ResourceClaim (``results`` None: not allocated; ``config``: the allocation's
        ``devices.config`` entries); the stored document."""
        claim: dict[str, Any] = {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": self._meta(name, namespace, uid),
            "spec": {"devices": {"requests": [
                {"name": request, "exactly": {"deviceClassName": "gpu.isolator.dev", "count": 1}}
                for request in sorted({r["request"] for r in results or []}) or ["gpus"]]}},
        }
        if results is not None:
            devices: dict[str, Any] = {"results": results}
            if config:
                devices["config"] = config
            claim["status"] = {"allocation": {"devices": devices},
                               "reservedFor": reserved_for or [{"resource": "pods", "name": f"{name}-pod",
                                                                "uid": str(uuid.uuid4())}]}
        with self._changed:
            self.claims[(namespace, name)] = claim
        return claim

    def allocate(self, namespace: str, name: str, *, driver: str, node: str, requests: dict[str, str] | None = None,
                 **options: Any) -> dict:
        """Allocate and store the claim as the scheduler would (``dra_scheduler.allocate``); the stored claim."""
        from .dra_scheduler import allocate

        return allocate(self, namespace, name, driver=driver, node=node, requests=requests, **options)

    def remove_claim(self, namespace: str, name: str) -> None:
        with self._changed:
            self.claims.pop((namespace, name), None)

    def delete_slices(self, node: str) -> list[str]:
        """What a kubelet does at start: delete every ResourceSlice of ``node`` (any driver); their names."""
        with self._changed:
            names = [name for name, s in self.resource_slices.items() if s["spec"].get("nodeName") == node]
            for name in names:
                self._slices("DELETE", name, {}, None)
            self._record("DELETE", f"{GROUP}/resourceslices", f"fieldSelector=spec.nodeName%3D{node}",
                         f"200 deleted {len(names)} slices (the kubelet)")
        return names

    def slices(self, node: str | None = None) -> list[dict]:
        with self._changed:
            return [json.loads(json.dumps(s)) for s in self.resource_slices.values()
                    if node is None or s["spec"].get("nodeName") == node]

    def _event(self, kind: str, document: dict) -> None:
        self.events.append((int(document["metadata"]["resourceVersion"]), kind, json.loads(json.dumps(document))))
        self._changed.notify_all()

    # -- watches ------------------------------------------------------------------------
    def watch_events(self, query: dict[str, list[str]], connection: socket.socket,
                     send: Callable[[bytes], None]) -> None:
        """Stream the slice events a ``watch=true`` list asks for (see module rules) until its
        ``timeoutSeconds``, the client hangs up, or the server closes."""
        fields = dict(term.partition("=")[::2] for selector in query.get("fieldSelector", [])
                      for term in filter(None, selector.split(",")))
        wanted = {"nodeName": fields.get("spec.nodeName"), "driver": fields.get("spec.driver")}

        def matches(document: dict) -> bool:
            return all(value is None or document["spec"].get(key) == value for key, value in wanted.items())

        deadline = time.monotonic() + float(query.get("timeoutSeconds", ["1800"])[0])
        with self._changed:
            since = query.get("resourceVersion", [""])[0]
            if since:
                after = int(since)
                pending = []
            else:  # no version: the current state as ADDED events, then what follows
                after = max([version for version, _, _ in self.events] + [0])
                pending = [("ADDED", json.loads(json.dumps(s))) for s in self.resource_slices.values() if matches(s)]
        while self._server is not None and time.monotonic() < deadline:
            for kind, document in pending:
                send((json.dumps({"type": kind, "object": document}) + "\n").encode())
            with self._changed:
                fresh = [(version, kind, document) for version, kind, document in self.events if version > after]
                if not fresh:
                    self._changed.wait(0.2)
                    fresh = [(v, k, d) for v, k, d in self.events if v > after]
            if fresh:
                after = fresh[-1][0]
            pending = [(kind, document) for _, kind, document in fresh if matches(document)]
            readable, _, _ = select.select([connection], [], [], 0)
            if readable and not connection.recv(1, socket.MSG_PEEK):
                return  # the client hung up

    # -- records ------------------------------------------------------------------------
    def _record(self, method: str, path: str, query: str, summary: str) -> None:
        with self._changed:
            self.requests.append((len(self.requests), method, path, query, summary))
            self._changed.notify_all()

    def transcript(self, since: int = 0) -> str:
        return "\n".join(f"{seq:3d} {method:6s} {path}{'?' + query if query else ''} -> {summary}"
                         for seq, method, path, query, summary in self.requests[since:])

    def wait_for(self, predicate: Callable[["FakeApiServer"], Any], what: str, timeout: float = WAIT) -> Any:
        return self._wait(lambda: predicate(self), what, timeout)

    # -- the API ------------------------------------------------------------------------
    def handle(self, method: str, path: str, query: dict[str, list[str]], body: dict | None) -> tuple[int, dict]:
        with self._changed:
            if self._failures:
                code = self._failures.pop(0)
                return code, _status(code, "ServiceUnavailable", "the fake API server was told to fail")
            parts = path[len(GROUP):].strip("/").split("/") if path.startswith(GROUP + "/") else None
            if parts and parts[0] == "namespaces" and len(parts) >= 3 and parts[2] == "resourceclaims":
                return self._claims(method, parts[1], parts[3] if len(parts) > 3 else None, body)
            if parts == ["resourceclaims"] and method == "GET":
                return 200, self._claim_list(None)
            if parts and parts[0] == "resourceslices":
                return self._slices(method, parts[1] if len(parts) > 1 else None, query, body)
            return 404, _status(404, "NotFound", f"the fake API server serves no {path}")

    def _claim_list(self, namespace: str | None) -> dict:
        items = [claim for (ns, _), claim in sorted(self.claims.items()) if namespace is None or ns == namespace]
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimList",
                "metadata": {"resourceVersion": str(next(self._versions))}, "items": json.loads(json.dumps(items))}

    def _claims(self, method: str, namespace: str, name: str | None, body: dict | None) -> tuple[int, dict]:
        if method == "GET" and name is None:
            return 200, self._claim_list(namespace)
        if method == "GET" and name is not None:
            claim = self.claims.get((namespace, name))
            if claim is None:
                return 404, _status(404, "NotFound", f'resourceclaims.resource.k8s.io "{name}" not found')
            return 200, claim
        if method == "POST" and body is not None:
            body["metadata"] = {**body.get("metadata", {}), **self._meta(body["metadata"]["name"], namespace)}
            self.claims[(namespace, body["metadata"]["name"])] = body
            return 201, body
        return 405, _status(405, "MethodNotAllowed", f"{method} on resourceclaims")

    def _slices(self, method: str, name: str | None, query: dict[str, list[str]], body: dict | None
                ) -> tuple[int, dict]:
        if name is None and method == "GET":
            items = list(self.resource_slices.values())
            for selector in query.get("fieldSelector", []):
                for term in filter(None, selector.split(",")):
                    key, _, value = term.partition("=")
                    field = {"spec.nodeName": "nodeName", "spec.driver": "driver"}.get(key)
                    if field is None:
                        return 400, _status(400, "BadRequest", f"field label not supported: {key}")
                    items = [s for s in items if s["spec"].get(field) == value]
            for selector in query.get("labelSelector", []):
                for term in filter(None, selector.split(",")):
                    key, _, value = term.partition("=")
                    items = [s for s in items if s["metadata"].get("labels", {}).get(key) == value]
            return 200, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                         "metadata": {"resourceVersion": str(next(self._versions))}, "items": items}
        invalid = _invalid_name(body) if method in ("POST", "PUT") and body is not None else None
        if invalid is not None:
            return 422, invalid
        if name is None and method == "POST" and body is not None:
            new = body["metadata"]["name"]
            if new in self.resource_slices:
                return 409, _status(409, "AlreadyExists", f'resourceslices.resource.k8s.io "{new}" already exists')
            body["metadata"] = {**body["metadata"], **self._meta(new)}
            self.resource_slices[new] = body
            self._event("ADDED", body)
            return 201, body
        stored = self.resource_slices.get(name) if name is not None else None
        if stored is None:
            return 404, _status(404, "NotFound", f'resourceslices.resource.k8s.io "{name}" not found')
        if method == "GET":
            return 200, stored
        if method == "PUT" and body is not None:
            if body.get("metadata", {}).get("resourceVersion") != stored["metadata"]["resourceVersion"]:
                return 409, _status(409, "Conflict", f'Operation cannot be fulfilled on resourceslices.resource.k8s.io'
                                                     f' "{name}": the object has been modified')
            body["metadata"] = {**body["metadata"], "uid": stored["metadata"]["uid"],
                                "resourceVersion": str(next(self._versions)),
                                "creationTimestamp": stored["metadata"]["creationTimestamp"]}
            self.resource_slices[name] = body
            self._event("MODIFIED", body)
            return 200, body
        if method == "DELETE":
            del self.resource_slices[name]
            self._event("DELETED", {**stored, "metadata": {**stored["metadata"],
                                                           "resourceVersion": str(next(self._versions))}})
            return 200, stored
        return 405, _status(405, "MethodNotAllowed", f"{method} on resourceslices")


def _invalid_name(body: dict) -> dict | None:
    """The API server's 422 for a ResourceSlice name that is no DNS subdomain of at most 253 characters, or for
    request policies it refuses."""
    from .dra_scheduler import capacity_errors

    name = body.get("metadata", {}).get("name", "")
    errors = capacity_errors(body)
    if errors:
        return _status(422, "Invalid", f'ResourceSlice.resource.k8s.io "{name}" is invalid: {"; ".join(errors)}')
    if len(name) > 253:
        why = "must be no more than 253 characters"
    elif not _SUBDOMAIN.fullmatch(name):
        why = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.'"
    else:
        return None
    return _status(422, "Invalid", f'ResourceSlice.resource.k8s.io "{name}" is invalid: metadata.name: Invalid value:'
                                   f' "{name}": {why}')


def _summary(method: str, code: int, body: dict | None, answer: dict) -> str:
    if answer.get("kind") == "Status":
        return f"{code} {answer.get('reason')}: {answer.get('message')}"
    if answer.get("kind") == "ResourceSliceList":
        return f"{code} {len(answer['items'])} slices"
    if answer.get("kind") == "ResourceSlice":
        spec = answer["spec"]
        tainted = [d["name"] for d in spec.get("devices", []) if d.get("taints")]
        return (f"{code} slice {answer['metadata']['name']} pool {spec['pool']['name']} generation"
                f" {spec['pool']['generation']}: {len(spec.get('devices', []))} devices"
                + (f", tainted {','.join(tainted)}" if tainted else ""))
    if answer.get("kind") == "ResourceClaimList":
        return f"{code} {len(answer['items'])} claims"
    if answer.get("kind") == "ResourceClaim":
        meta = answer["metadata"]
        return f"{code} claim {meta['namespace']}/{meta['name']} uid {meta['uid']}"
    return str(code)


class _Server(ThreadingHTTPServer):
    """A client that dies mid-request (a driver SIGKILLed) is what a server sees every day: not printed."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


def _handler(api: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the records are the log
            pass

        def setup(self) -> None:
            super().setup()
            # Headers and body go out in two writes: without this, the client's delayed ACK holds the body ~40 ms.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with api._changed:
                api._connections.add(self.connection)

        def finish(self) -> None:
            with api._changed:
                api._connections.discard(self.connection)
            super().finish()

        def _serve(self) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            if api.delay_s:
                time.sleep(api.delay_s)
            if parse_qs(url.query).get("watch") == ["true"] and url.path == f"{GROUP}/resourceslices":
                return self._watch(url)
            code, answer = api.handle(self.command, url.path, parse_qs(url.query), body)
            api._record(self.command, url.path, url.query, _summary(self.command, code, body, answer))
            data = json.dumps(answer).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                pass  # the client gave up (a slow server's timeout)

        def _watch(self, url: Any) -> None:
            with api._changed:
                failure = api._failures.pop(0) if api._failures else None
            api._record("GET", url.path, url.query, f"{failure or 200} watch")
            if failure is not None:
                data = json.dumps(_status(failure, "ServiceUnavailable", "the fake API server was told to fail"))
                self.send_response(failure)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())
                return

            def send(data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            try:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                api.watch_events(parse_qs(url.query), self.connection, send)
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass  # the client hung up, or the server was closed
            self.close_connection = True

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

    return Handler
