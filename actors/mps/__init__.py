"""MPS: the control daemons a front door runs to share a unit with limits (SPEC section 25).

``MpsDaemons`` runs one ``nvidia-cuda-mps-control -d`` per shared unit (a
GPU or a MIG device) as the front door's own, sets each share's limits
through it, restarts it when it dies and stops it with the unit's last
share; ``ShareLimits`` and ``ShareState`` are what a share asks and has;
``DaemonPaths`` says where a unit's daemon keeps its pipes and its log;
``validate_mps_cgroup`` checks the cgroup the daemons are started in, out of
the front door's own (``DEFAULT_MPS_CGROUP``; ``NO_CGROUP``: the front door's).
Rules of each piece are at the top of its module; the facts about MPS they
rely on are cited in docs/guides/mps.md.
"""

from ._cgroup import DEFAULT_MPS_CGROUP, NO_CGROUP, validate_mps_cgroup
from ._daemon import DaemonPaths
from ._errors import MpsDaemonFailed, MpsError, UnequalShare
from ._manager import DEFAULT_MPS_CONTROL, MpsDaemons, ShareLimits, ShareState

__all__ = ["DEFAULT_MPS_CGROUP", "DEFAULT_MPS_CONTROL", "NO_CGROUP", "DaemonPaths", "MpsDaemonFailed", "MpsError",
           "MpsDaemons", "ShareLimits", "ShareState", "UnequalShare", "validate_mps_cgroup"]
