"""What a malicious local user does to the service, run as a throwaway user (issue 25).

Rules:
- ``main(argv)`` is run by ``ThrowawayUser.popen("tests.support.attacker",
  ACTION, ...)``; each action prints one JSON line of what happened, so a
  test compares facts, never timings:
  - ``ask SOCKET VERB BODY``: one request (BODY a JSON object) on a
    connection of its own; ``{"verb", "body"}`` of the answer, or
    ``{"refused": text}`` / ``{"lost": text}``.
  - ``race SOCKET STOPFILE``: until STOPFILE exists, reads the state and
    sends ``cleanup`` and ``update`` for every container it shows (what
    finding 2 did between a victim's prepare and start); the refusals by
    text and how many containers it saw.
  - ``hold SOCKET N``: opens N connections and asks ``state`` on each:
    how many were answered and the refusals; then holds them idle until
    its stdin closes, and says how many the service closed meanwhile.
  - ``frames SOCKET``: the frames that are not requests, one connection
    each: a length over the limit, bytes that are not JSON, descriptors
    with a ``state`` request, a prepare naming a 9000-character id (a
    request, refused); the answer to each.
  - ``stall SOCKET``: the first bytes of a frame, then nothing: what the
    service answers (it closes the connection after its idle timeout).
  - ``tcp-hold HOST PORT N``: N idle TCP connections to ``--listen``,
    held until its stdin closes.
- Standard library and ``isolators.service``'s client only (imported
  before the process became the user).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from typing import Any

from isolators.service._client import LostService, Refused, SocketClient
from isolators.service._frames import FrameReader, encode, recv_frame, send_frame


def _say(value: Any) -> None:
    print(json.dumps(value), flush=True)


def ask(path: str, verb: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        with SocketClient.connect(path, timeout=20) as client:
            client.on_queued = lambda _body: None
            frame = client.ask(verb, body, timeout=20)
            return {"verb": frame.verb, "body": frame.body}
    except Refused as error:
        return {"refused": str(error)}
    except LostService as error:
        return {"lost": str(error)}


def race(path: str, stop: str) -> dict[str, Any]:
    refused: dict[str, int] = {}
    seen: set[str] = set()
    while not os.path.exists(stop):
        state = ask(path, "state", {})
        for name in state.get("body", {}).get("containers", {}):
            seen.add(name)
        for name in list(seen):
            for verb, body in (("cleanup", {"container_id": name}), ("update", {"container_id": name, "gpus": 0})):
                answer = ask(path, verb, body).get("body", {})
                text = (answer.get("error") or "ok").replace(name, "ID")
                refused[text] = refused.get(text, 0) + 1
    return {"refused": refused, "seen": len(seen)}


def hold(path: str, count: int) -> None:
    held, answered, refusals = [], 0, []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(20)
        sock.connect(path)
        reader = FrameReader()
        try:
            send_frame(sock, "state", {"request": "s"})
        except OSError:
            pass  # refused and closed already: its refusal is still there to read
        try:
            frame = recv_frame(sock, reader)
            outcome = "closed" if frame is None else frame.body.get("error") if frame.verb == "error" else None
        except OSError as error:
            outcome = str(error)
        if outcome is None:
            answered += 1
            held.append((sock, reader))
        else:
            refusals.append(outcome)
            sock.close()
    _say({"answered": answered, "refused": refusals})
    sys.stdin.read()
    closed = 0
    for sock, reader in held:
        sock.settimeout(0.0)
        try:
            data = sock.recv(65536)
            closed += data == b"" or b'"error"' in data
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        sock.close()
    _say({"closed_by_service": closed})


def frames(path: str) -> list[dict[str, Any]]:
    results = []
    cases = [
        ("over the limit", struct.pack(">I", (1 << 20) + 1), ()),
        ("not JSON", struct.pack(">I", 5) + b"{junk", ()),
        ("fds with state", encode("state", {"request": "s"}), (0,)),
        ("a 9000-character id", encode("prepare", {"request": "p", "container_id": "A" * 9000, "gpus": 1,
                                                  "command": ["true"], "cwd": "/"}), ()),
    ]
    for name, data, fds in cases:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(20)
            sock.connect(path)
            if fds:
                sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
            else:
                sock.sendall(data)
            frame = recv_frame(sock, FrameReader())
            results.append({"case": name, "verb": frame.verb if frame else None,
                            "error": (frame.body.get("error") if frame else None)})
    return results


def stall(path: str) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect(path)
        sock.sendall(encode("state", {"request": "s"})[:6])
        frame = recv_frame(sock, FrameReader())
        return {"verb": frame.verb if frame else None, "error": frame.body.get("error") if frame else None}


def tcp_hold(host: str, port: int, count: int) -> None:
    held = [socket.create_connection((host, port), timeout=10) for _ in range(count)]
    _say({"held": len(held)})
    sys.stdin.read()
    for sock in held:
        sock.close()


def main(argv: list[str]) -> int:
    action, args = argv[0], argv[1:]
    if action == "ask":
        _say(ask(args[0], args[1], json.loads(args[2])))
    elif action == "race":
        _say(race(args[0], args[1]))
    elif action == "hold":
        hold(args[0], int(args[1]))
    elif action == "frames":
        _say(frames(args[0]))
    elif action == "stall":
        _say(stall(args[0]))
    elif action == "tcp-hold":
        tcp_hold(args[0], int(args[1]), int(args[2]))
    else:
        raise SystemExit(f"unknown action {action!r}")
    return 0
