"""R-SC-6 / R-K8-9: the bearer credential is trusted only from a root-owned, private file."""

from __future__ import annotations

import os

import pytest

from isolators.credential import BearerCredential, CredentialError

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as root and as another uid")


def write(path, text: str, mode: int = 0o600) -> str:
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


@needs_root
def test_a_root_owned_private_file_is_loaded_and_only_its_secret_is_accepted(tmp_path) -> None:
    credential = BearerCredential.load(write(tmp_path / "secret", "s3cret\n"))
    assert credential.accepts({"authorization": "Bearer s3cret"})
    assert not credential.accepts({"authorization": "Bearer s3cre"})
    assert not credential.accepts({"authorization": "Bearer s3cret2"})
    assert not credential.accepts({"authorization": "Basic s3cret"})
    assert not credential.accepts({"authorization": "\u00e9"})  # undecodable text is just wrong
    assert not credential.accepts({})
    assert "s3cret" not in repr(credential)
    assert BearerCredential.load(write(tmp_path / "ro", "x", 0o400)).accepts({"authorization": "Bearer x"})


@needs_root
@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_a_file_others_may_read_is_refused_naming_the_fix(tmp_path, mode: int) -> None:
    path = write(tmp_path / "secret", "s3cret", mode)
    with pytest.raises(CredentialError) as failed:
        BearerCredential.load(path)
    assert str(failed.value) == f"Credential {path!r} has mode {mode:04o}: others may read it; chmod 600 {path}"


@needs_root
def test_a_file_owned_by_another_user_is_refused(tmp_path) -> None:
    path = write(tmp_path / "secret", "s3cret")
    os.chown(path, 65534, 65534)
    with pytest.raises(CredentialError, match=r"is owned by uid 65534, not root: chown root "):
        BearerCredential.load(path)


@needs_root
def test_a_symlink_an_empty_file_and_a_missing_file_are_refused(tmp_path) -> None:
    target = write(tmp_path / "secret", "s3cret")
    os.symlink(target, tmp_path / "link")
    with pytest.raises(CredentialError, match=r"it is a symbolic link: point --credential at the file itself"):
        BearerCredential.load(str(tmp_path / "link"))
    with pytest.raises(CredentialError, match=r"is empty: write a secret into it"):
        BearerCredential.load(write(tmp_path / "empty", " \n"))
    with pytest.raises(CredentialError, match=r"Cannot open credential .*missing.*: No such file or directory"):
        BearerCredential.load(str(tmp_path / "missing"))
    os.mkdir(tmp_path / "dir", 0o700)
    with pytest.raises(CredentialError, match=r"is not a regular file"):
        BearerCredential.load(str(tmp_path / "dir"))


def test_the_refusal_is_401_with_a_bearer_challenge() -> None:
    response = BearerCredential.unauthorized()
    assert response.status == 401
    assert response.headers == {"WWW-Authenticate": 'Bearer realm="gpu-isolator"'}
    assert b"Authorization: Bearer <secret>" in response.body
