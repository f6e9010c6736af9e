"""BearerCredential: the secret that lets a TCP caller change or read containers (R-SC-6, R-K8-9).

Rules:
- ``BearerCredential.load(path)`` reads the secret from a file the way sshd
  trusts its files (StrictModes): the file must be a regular file (not a
  symlink; opened ``O_NOFOLLOW``), owned by root, with no access for group
  or others (mode 0600 or 0400), and hold a non-empty secret (surrounding
  whitespace is stripped). Anything else raises ``CredentialError`` naming
  the path, what is wrong and what to do.
- ``accepts(headers)`` is true exactly when the request's (lower-cased)
  ``authorization`` header is ``Bearer <secret>``; the comparison takes the
  same time wherever the values differ (``hmac.compare_digest``).
- ``unauthorized()`` is the one answer to a request without it: 401 with
  ``WWW-Authenticate: Bearer``, saying how to authenticate. The caller
  changes nothing before it has checked.
- The secret never appears in ``repr``, logs or errors.
"""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Mapping

from runtime import Failure, Response

__all__ = ["BearerCredential", "CredentialError"]


class CredentialError(Failure):
    """A credential file the service must not trust (or cannot read)."""


class BearerCredential:
    """A shared secret presented as ``Authorization: Bearer <secret>``."""

    __slots__ = ("path", "_expected")

    def __init__(self, secret: bytes, path: str = "<memory>") -> None:
        if not secret:
            raise CredentialError(f"Credential {path!r} is empty: write a secret into it (e.g. openssl rand -hex 32)")
        self.path = path
        self._expected = b"Bearer " + secret

    @classmethod
    def load(cls, path: str) -> "BearerCredential":
        """The credential in ``path``, checked as the module rules say."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError as exc:
            hint = " (it is a symbolic link: point --credential at the file itself)" if os.path.islink(path) else ""
            raise CredentialError(f"Cannot open credential {path!r}: {exc.strerror}{hint}") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CredentialError(f"Credential {path!r} is not a regular file")
            if info.st_uid != 0:
                raise CredentialError(
                    f"Credential {path!r} is owned by uid {info.st_uid}, not root: chown root {path}"
                )
            if info.st_mode & 0o077:
                raise CredentialError(
                    f"Credential {path!r} has mode {stat.S_IMODE(info.st_mode):04o}: others may read it;"
                    f" chmod 600 {path}"
                )
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        finally:
            os.close(fd)
        return cls(b"".join(chunks).strip(), path)

    def accepts(self, headers: Mapping[str, str]) -> bool:
        """Whether ``headers`` (names lower-cased) carry ``Authorization: Bearer <secret>``."""
        presented = headers.get("authorization")
        if presented is None:
            return False
        return hmac.compare_digest(presented.strip().encode("latin-1", "replace"), self._expected)

    @staticmethod
    def unauthorized() -> Response:
        """401 for a request without the credential."""
        return Response(
            "401 Unauthorized: this request needs 'Authorization: Bearer <secret>'"
            " with the secret of the service's --credential file\n",
            401,
            headers={"WWW-Authenticate": 'Bearer realm="gpu-isolator"'},
        )

    def __repr__(self) -> str:
        return f"<BearerCredential from {self.path!r}>"
