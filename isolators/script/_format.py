"""The format of a message script: typed steps decoded by msgspec.

Rules:
- A script is ``name``, ``description``, ``node`` and ``steps``. ``node``
  names the simulated node: ``gpus`` (a count, or a list of GPU tables as a
  host file writes them, with ``nvlink``, ``numa_node``, ``pcie_switch``...)
  or ``host_file`` (relative to the script's directory); ``driver_version``,
  ``control_devices``, the device ``backend`` (``memory``, ``cgroups_v1``,
  ``cgroups_v2``) and extra ``flags`` (not the ones the runner sets).
- A step holds exactly one action (a key of ``ACTIONS``), an optional
  ``name`` and an optional ``expect``; ``Step`` and the ``CallStep`` inside
  ``concurrent`` are built from the registry of actions.
- After loading, every step has ``line`` (1-based; 0 if unknown), ``where``
  (its JSON path, ``$.steps[3]``) and ``action`` (its action's name), and
  the script has ``source`` and ``base_dir``; none of them is a field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from actors.flags import NODE_BACKENDS
from actors.nvml import MAX_GPUS

from . import _actions
from ._action import ACTIONS, MAX_STEPS, Expect, ScriptError, Text, concurrent_actions, step_type

BACKENDS = NODE_BACKENDS
"""The backends a script's node may name (``actors.flags.NODE_BACKENDS``)."""

CallStep = _actions.CallStep
Step = step_type("Step", tuple(ACTIONS), Expect, "One step: exactly one action, a name and an expectation.")


class Node(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The simulated node a script runs on."""

    gpus: Annotated[int, msgspec.Meta(ge=0, le=MAX_GPUS)] | list[dict[str, Any]] | None = None
    host_file: str | None = None
    driver_version: str | None = None
    control_devices: dict[str, str] | None = None
    backend: Literal[NODE_BACKENDS] = "memory"  # type: ignore[valid-type]
    flags: dict[str, Any] = {}


class Script(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, dict=True):
    """A whole script (see module rules)."""

    name: Text | None = None
    description: Text = ""
    node: Node = msgspec.field(default_factory=Node)
    steps: Annotated[list[Step], msgspec.Meta(min_length=1, max_length=MAX_STEPS)]  # type: ignore[valid-type]


def host_document(node: Node) -> dict[str, Any]:
    """The host file a node without ``host_file`` stands for (8 GPUs by default)."""
    document: dict[str, Any] = {}
    if isinstance(node.gpus, list):
        document["gpus"] = node.gpus
    else:
        document["gpu_count"] = 8 if node.gpus is None else node.gpus
    if node.driver_version is not None:
        document["driver_version"] = node.driver_version
    if node.control_devices is not None:
        document["control_devices"] = node.control_devices
    return document


def _allowed(step: Any) -> tuple[str, ...]:
    return concurrent_actions() if isinstance(step, CallStep) else tuple(ACTIONS)


def one_action_problem(step: Any) -> str | None:
    """What is wrong with the actions a step holds (None: exactly one)."""
    names = _allowed(step)
    present = [name for name in names if getattr(step, name) is not None]
    if len(present) == 1:
        return None
    inside = " inside 'concurrent'" if isinstance(step, CallStep) else ""
    got = " and ".join(f"'{name}'" for name in present) if present else "none"
    return f"a step{inside} holds exactly one action ({', '.join(names)}); got {got}"


def step_where(step: Any) -> str:
    line = getattr(step, "line", 0)
    where = getattr(step, "where", "$.steps[?]")
    return f"line {line}: {where}" if line else where


def step_action(step: Any) -> str:
    """The one action a step holds (ScriptError naming the step otherwise)."""
    problem = one_action_problem(step)
    if problem is not None:
        raise ScriptError(f"{step_where(step)}: {problem}")
    return next(name for name in _allowed(step) if getattr(step, name) is not None)


def action_title(step: Any, action: str | None = None) -> str:
    """What a step does, in words (``prepare c1 (gpus:2)``)."""
    action = action or step.action
    return ACTIONS[action].title(getattr(step, action))
