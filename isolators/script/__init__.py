"""Message scripts: whole isolator scenarios as data (YAML or JSON).

A script names a simulated node and lists steps; each step holds one action
(an isolator call, a concurrent group, a clock advance, an agent restart,
an assertion on the free GPUs ...) and what it expects. ``load_script``
turns text into a typed ``Script`` or one line-numbered ``ScriptError``;
``run_script`` / ``ScriptRunner`` run it on a ``SimulatedNode`` and report
every step (``ScriptReport``, ``StepResult``). Those entry points are
exported by ``isolators``; this package exports what extends scripts: the
registry of actions, the step types and the limits.

The pieces, each with its rules at the top: ``_action`` (what an action is,
the registry, the limits), ``_actions`` (one class per action), ``_format``
(the Structs built from the registry), ``_loading`` (text to Script, with
the checks against hostile input), ``_report`` and ``_runner``. A new action
is one class in ``_actions``.
"""

from ._action import (
    ACTIONS,
    MAX_CALLS,
    MAX_DEPTH,
    MAX_NODES,
    MAX_REPEAT,
    MAX_SCRIPT_BYTES,
    MAX_STEPS,
    Action,
    CallExpect,
    Expect,
    Mismatch,
    action,
    concurrent_actions,
)
from ._format import BACKENDS, CallStep, Node, Step, action_title, step_action
from ._report import format_result

__all__ = [
    "ACTIONS", "MAX_CALLS", "MAX_DEPTH", "MAX_NODES", "MAX_REPEAT", "MAX_SCRIPT_BYTES", "MAX_STEPS",
    "Action", "CallExpect", "Expect", "Mismatch", "action", "concurrent_actions",
    "BACKENDS", "CallStep", "Node", "Step", "action_title", "step_action", "format_result",
]
