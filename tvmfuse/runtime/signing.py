"""The artifact manifest's signature: HMAC-SHA256 with a key kept outside the artifact.

The manifest holds the sha256s of ``model.so`` and ``params.npz``, but it sits beside them: whoever swaps the
library can rewrite the manifest too. The signature binds the manifest to a key the artifact folder does not
carry, so a changed manifest (and through its sha256s, a changed library or set of weights) no longer verifies.

The key: ``TVMFUSE_SIGNING_KEY`` (hex, or any other text taken as its UTF-8 bytes) when set, else the per-user
key file ``$XDG_CONFIG_HOME/tvmfuse/signing.key`` (``~/.config/...``), created with mode 0600 by the first
``compile``. A machine that runs artifacts built elsewhere needs the same key (copy the file, or set the
variable). Signing and verifying are an HMAC, not a public-key signature: whoever can verify can also sign,
so the key must be kept as private as the right to ship code to the machine.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from tvmfuse.errors import ArtifactError

KEY_ENV = "TVMFUSE_SIGNING_KEY"
SIGNATURE_KEY, SIGNED_BY_KEY = "signature", "signed_by"
_PREFIX = "hmac-sha256:"
_MIN_KEY_BYTES = 16  # an HMAC key shorter than this is guessable; the generated key is 32 bytes
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")

BAD_SIGNATURE = "manifest signature does not match: the artifact was changed or signed with another key"


class UntrustedArtifactWarning(UserWarning):
    """An artifact was loaded without a signature check that passed (``trust_unsigned``)."""


@dataclass(frozen=True)
class SigningKey:
    key: bytes
    source: str  # where it came from, for messages: the variable's name or the file's path

    @property
    def key_id(self) -> str:
        return key_id(self.key)


def key_id(key: bytes) -> str:
    """A short public name of a key: the first 16 hex digits of its sha256 (it says which key, not the key)."""
    return hashlib.sha256(key).hexdigest()[:16]


def key_path() -> Path:
    """The per-user key file, under ``$XDG_CONFIG_HOME`` when that is an absolute path (the XDG rule)."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".config"
    return root / "tvmfuse" / "signing.key"


def _parse(text: str, source: str) -> bytes:
    text = text.strip()
    key = bytes.fromhex(text) if _HEX.fullmatch(text) else text.encode("utf-8")
    if len(key) < _MIN_KEY_BYTES:
        raise ArtifactError(f"the signing key from {source} is {len(key)} bytes; give at least {_MIN_KEY_BYTES}",
                            hint="e.g. python -c 'import secrets; print(secrets.token_hex(32))'")
    return key


def _read_key_file(path: Path) -> bytes:
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"the signing key {path} is not a regular file")
        # another user who can read it can sign artifacts this machine trusts; one who can write it can swap it
        if st.st_mode & 0o077:
            raise ArtifactError(f"the signing key {path} is open to other users (mode {stat.S_IMODE(st.st_mode):04o})",
                                hint=f"chmod 600 {path}")
        return _parse(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError) as e:
        raise ArtifactError(f"cannot read the signing key {path}: {getattr(e, 'strerror', None) or e}") from None


def _create_key_file(path: Path) -> None:
    """Write a new random key at ``path``, mode 0600, atomically: a concurrent first ``compile`` either wins
    the link or reads the winner's key, never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def signing_key(*, create: bool = False) -> SigningKey | None:
    """This machine's signing key: ``TVMFUSE_SIGNING_KEY`` if set, else the key file; with ``create`` the key
    file is made when missing (``compile``), without it a missing key is None (loading never makes one: a new
    key could not verify anything)."""
    env = os.environ.get(KEY_ENV)
    if env is not None:
        if not env.strip():
            raise ArtifactError(f"{KEY_ENV} is set but empty", hint="unset it to use the key file, or give a key")
        return SigningKey(_parse(env, KEY_ENV), KEY_ENV)
    path = key_path()
    if not path.exists():
        if not create:
            return None
        try:
            _create_key_file(path)
        except OSError as e:
            raise ArtifactError(f"cannot create the signing key {path}: {e.strerror or e}",
                                hint=f"set {KEY_ENV} to sign with a key of your own") from None
    return SigningKey(_read_key_file(path), str(path))


def canonical(manifest: dict) -> bytes:
    """The signed bytes: the manifest without its signature, as sorted, compact JSON (whitespace and key order
    in the file do not matter; every value does)."""
    content = {k: v for k, v in manifest.items() if k != SIGNATURE_KEY}
    return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _mac(key: bytes, manifest: dict) -> str:
    return _PREFIX + hmac.new(key, canonical(manifest), hashlib.sha256).hexdigest()


def sign_manifest(manifest: dict, key: SigningKey) -> dict:
    """``manifest`` with ``signed_by`` (the key's id) and ``signature`` added. It is signed as it will read
    back from its JSON file (tuples become lists), so the loader computes the same bytes."""
    content = json.loads(json.dumps({k: v for k, v in manifest.items() if k != SIGNATURE_KEY}))
    content[SIGNED_BY_KEY] = key.key_id
    content[SIGNATURE_KEY] = _mac(key.key, content)
    return content


def check_manifest(manifest: dict, *, trust_unsigned: bool = False) -> dict:
    """Check the manifest's signature with this machine's key before anything of the artifact is loaded.

    Returns ``{"status", "signed_by", "key_id", "warning"}``: status ``verified``, or, only with
    ``trust_unsigned``, ``unsigned`` / ``other-key`` / ``no-key`` with the warning to show. Raises ArtifactError
    (exit 2) for a signature that does not match this machine's key (always: that is a changed manifest), and
    for an unsigned artifact, one signed with another key, or no key here, unless ``trust_unsigned``.
    """
    signature, signed_by = manifest.get(SIGNATURE_KEY), manifest.get(SIGNED_BY_KEY)
    key = signing_key(create=False)
    mine = key.key_id if key is not None else None
    anyway = "pass --trust-unsigned to load it anyway"

    def untrusted(status: str, why: str, fix: str | None = None) -> dict:
        if not trust_unsigned:
            raise ArtifactError(f"{why}; refusing to load it", hint=f"{fix}, or {anyway}" if fix else anyway)
        return {"status": status, "signed_by": signed_by, "key_id": mine,
                "warning": f"{why}; loaded anyway (--trust-unsigned): its files are checked only against its own "
                           "manifest"}

    deploy = (f"copy the signing key of the machine that compiled it to {key_path()} or set {KEY_ENV}; README, "
              "'Deploying an artifact to another machine'")
    if signature is None:
        return untrusted("unsigned", "the artifact's manifest is not signed", "recompile it with this tvmfuse")
    if key is None:
        return untrusted("no-key", "no signing key on this machine to check the artifact's signature with", deploy)
    if signed_by != mine:
        return untrusted("other-key", f"the artifact was signed with key {signed_by}, this machine's key "
                                      f"({key.source}) is {mine}", deploy)
    if not isinstance(signature, str) or not hmac.compare_digest(signature, _mac(key.key, manifest)):
        raise ArtifactError(BAD_SIGNATURE)
    return {"status": "verified", "signed_by": signed_by, "key_id": mine, "warning": None}
