"""The manifest's signature: what an attacker who can write the artifact folder (but not the key) can no longer do,
and what an artifact from elsewhere needs. Real compiles, real loads, the real key file."""
from __future__ import annotations

import hashlib
import json
import shutil
import stat
import warnings

import numpy as np
import pytest

from tvmfuse import api
from tvmfuse.errors import ArtifactError
from tvmfuse.runtime import load_artifact
from tvmfuse.runtime.signing import (BAD_SIGNATURE, KEY_ENV, SigningKey, UntrustedArtifactWarning, canonical,
                                     key_id, sign_manifest, signing_key)

OTHER_KEY = "5a" * 32


def _copy(artifact, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    return copy


def _edit_manifest(folder, change):
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest, indent=2))


@pytest.fixture()
def signed(example_artifact, tmp_path):
    """A copy of the session's artifact (signed with this user's key when the session compiled it)."""
    return _copy(example_artifact[0], tmp_path)


@pytest.mark.slow
def test_a_compiled_artifact_is_signed_and_verifies(signed):
    manifest = json.loads((signed / "manifest.json").read_text())
    key = signing_key()
    assert manifest["signed_by"] == key.key_id == hashlib.sha256(key.key).hexdigest()[:16]
    assert manifest["signature"].startswith("hmac-sha256:")
    art = load_artifact(signed)
    assert art.signature == {"status": "verified", "signed_by": key.key_id, "key_id": key.key_id, "warning": None}


@pytest.mark.slow
def test_an_edited_manifest_is_refused(signed):
    """A kernel renamed, the sha256s kept: the files still match the manifest, the signature does not."""
    _edit_manifest(signed, lambda m: m["kernels"][0].update(name="not_the_kernel_that_was_built"))
    with pytest.raises(ArtifactError) as e:
        load_artifact(signed)
    assert str(e.value) == BAD_SIGNATURE
    with pytest.raises(ArtifactError, match="signature does not match"):  # not even when told to trust unsigned ones
        load_artifact(signed, trust_unsigned=True)


@pytest.mark.slow
def test_swapped_weights_with_a_rewritten_sha256_are_refused(signed):
    with np.load(signed / "params.npz") as npz:
        params = {k: np.zeros_like(npz[k]) for k in npz.files}
    np.savez(signed / "params.npz", **params)
    digest = hashlib.sha256((signed / "params.npz").read_bytes()).hexdigest()
    _edit_manifest(signed, lambda m: m["files"].update({"params.npz": digest}))
    with pytest.raises(ArtifactError) as e:
        load_artifact(signed)
    assert str(e.value) == BAD_SIGNATURE


@pytest.mark.slow
def test_an_artifact_signed_with_another_key_is_refused_unless_trusted(signed, monkeypatch):
    monkeypatch.setenv(KEY_ENV, OTHER_KEY)
    with pytest.raises(ArtifactError, match=f"signed with key [0-9a-f]{{16}}, this machine's key .* is "
                                            f"{key_id(bytes.fromhex(OTHER_KEY))}.*--trust-unsigned"):
        load_artifact(signed)
    with pytest.warns(UntrustedArtifactWarning, match="loaded anyway"):
        art = load_artifact(signed, trust_unsigned=True)
    assert art.signature["status"] == "other-key"
    # re-signed with that key (what `compile` does where it is the key), it verifies
    manifest = json.loads((signed / "manifest.json").read_text())
    (signed / "manifest.json").write_text(json.dumps(sign_manifest(manifest, SigningKey(bytes.fromhex(OTHER_KEY),
                                                                                        KEY_ENV))))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_artifact(signed).signature["status"] == "verified"


@pytest.mark.slow
def test_an_unsigned_artifact_is_refused_unless_trusted(signed):
    _edit_manifest(signed, lambda m: [m.pop("signature"), m.pop("signed_by")])
    with pytest.raises(ArtifactError, match="not signed; refusing to load it.*--trust-unsigned"):
        load_artifact(signed)
    with pytest.warns(UntrustedArtifactWarning):
        art = load_artifact(signed, trust_unsigned=True)
    assert art.signature["status"] == "unsigned"
    # the sha256s are still checked: trusting an unsigned artifact is not trusting a corrupted one
    with open(signed / "model.so", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ArtifactError, match="sha256"), pytest.warns(UntrustedArtifactWarning):
        load_artifact(signed, trust_unsigned=True)


@pytest.mark.slow
def test_no_key_on_this_machine_is_refused_with_how_to_deploy(signed, monkeypatch, tmp_path):
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "empty_config"))
    with pytest.raises(ArtifactError, match="no signing key on this machine.*signing.key.*TVMFUSE_SIGNING_KEY"):
        load_artifact(signed)
    assert not (tmp_path / "empty_config").exists()  # loading never makes a key


def test_compile_creates_a_private_key_file_and_signs_with_it(example_model, tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    out = tmp_path / "art"
    api.compile(api.ModelConfig(model=example_model, target="llvm"), out=out, untuned=True)
    key_file = tmp_path / "config" / "tvmfuse" / "signing.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    key = bytes.fromhex(key_file.read_text().strip())
    assert len(key) == 32
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["signed_by"] == key_id(key)
    assert api.run(out, repeat=0)["signature"]["status"] == "verified"
    # a second compile signs with the same key; another user able to read the key makes it unusable
    api.compile(api.ModelConfig(model=example_model, target="llvm"), out=out, untuned=True)
    assert json.loads((out / "manifest.json").read_text())["signed_by"] == key_id(key)
    key_file.chmod(0o644)
    with pytest.raises(ArtifactError, match="open to other users.*chmod 600"):
        load_artifact(out)


@pytest.mark.parametrize("value,expected", [("00112233445566778899aabbccddeeff", bytes(range(0, 256, 17))),
                                            ("a text passphrase of some length", b"a text passphrase of some length")],
                         ids=["hex", "text"])
def test_the_key_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv(KEY_ENV, value)
    key = signing_key()
    assert key.key == expected and key.source == KEY_ENV
    for bad in ("", "short"):
        monkeypatch.setenv(KEY_ENV, bad)
        with pytest.raises(ArtifactError, match=KEY_ENV):
            signing_key()


def test_the_signed_bytes_ignore_layout_but_not_content():
    a = {"b": [1, 2.5, "é"], "a": {"y": None, "x": True}}
    b = json.loads(json.dumps(a, indent=4))
    b["signature"] = "hmac-sha256:00"
    assert canonical(a) == canonical(b)
    b["a"]["x"] = False
    assert canonical(a) != canonical(b)
