"""The bpf(2) calls cgroup v2 device control makes, for tools that drive the
kernel directly: the churn benchmark's raw-kernel floor and the kernel tests
(load a ``BPF_PROG_TYPE_CGROUP_DEVICE`` program, attach, detach, query what
is attached, open a program by id, read its info, tags and instructions).

The rules (errors, file descriptors, kernel facts) are those of ``_bpf``,
which device control itself uses.
"""

from ._bpf import BPF_F_ALLOW_MULTI, BPF_F_QUERY_EFFECTIVE, BPF_F_REPLACE, ProgInfo, prog_attach, prog_detach
from ._bpf import prog_get_fd_by_id
from ._bpf import prog_info, prog_load, prog_query, prog_xlated, program_tags

__all__ = [
    "BPF_F_ALLOW_MULTI", "BPF_F_QUERY_EFFECTIVE", "BPF_F_REPLACE", "ProgInfo", "prog_attach", "prog_detach",
    "prog_get_fd_by_id",
    "prog_info", "prog_load", "prog_query", "prog_xlated", "program_tags",
]
