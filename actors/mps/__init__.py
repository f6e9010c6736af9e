"""MPS: the control daemons a front door runs to share a unit with limits (SPEC section 25).

``MpsDaemons`` runs one ``nvidia-cuda-mps-control -d`` per shared unit (a
GPU or a MIG device) as the front door's own, sets each share's limits
through it, restarts it when it dies and stops it with the unit's last
share; ``ShareLimits`` and ``ShareState`` are what a share asks and has;
``DaemonPaths`` says where a unit's daemon keeps its pipes and its log.
Rules of each piece are at the top of its module; the facts about MPS they
rely on are cited in docs/guides/mps.md.
"""

from ._daemon import DaemonPaths
from ._errors import MpsDaemonFailed, MpsError
from ._manager import DEFAULT_MPS_CONTROL, MpsDaemons, ShareLimits, ShareState

__all__ = ["DaemonPaths", "MpsDaemonFailed", "MpsError", "DEFAULT_MPS_CONTROL", "MpsDaemons", "ShareLimits",
           "ShareState"]
