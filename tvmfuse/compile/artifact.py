"""Write a deployable artifact folder: the compiled library, the weights, and a manifest.

    ARTIFACT/
      model.so        the Relax VM executable (kernels + graph), loaded with tvm.runtime.load_module
      params.npz      the weights lifted out of the graph, passed after the inputs (param_0, param_1, ...)
      manifest.json   target, device, the machine it is for (CPU triple, CUDA arch), TVM/tvmfuse versions,
                      inputs/outputs, kernel schedules, sha256s, and an HMAC-SHA256 signature of all that
                      (``signature``, ``signed_by``)

Loading a library runs its code, so the loader (tvmfuse.runtime) checks the signature and the sha256s first.
The manifest is signed with a key kept outside the artifact (``tvmfuse.runtime.signing``): without it, whoever
swaps the library could rewrite the sha256s beside it.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from tvmfuse import __version__
from tvmfuse._tvm import tvm_version
from tvmfuse.compile.build import BuildResult
from tvmfuse.compile.cross import export_options
from tvmfuse.errors import ArtifactError
from tvmfuse.target import TargetInfo, device_figures

from tvmfuse.runtime.loaded import LIB_NAME, MANIFEST_NAME, PARAMS_NAME
from tvmfuse.runtime.loaded import _sha256 as sha256_file
from tvmfuse.runtime.signing import sign_manifest, signing_key

MANIFEST_FORMAT = 1


def export_artifact(result: BuildResult, out_dir: str | Path, *, target: TargetInfo, inputs, outputs,
                    model_path: str | Path | None = None, planner: str | None = None,
                    extra: dict | None = None) -> Path:
    """Write the artifact folder atomically (a temporary sibling renamed into place).

    Parameters
    ----------
    result : the :class:`BuildResult` to ship
    out_dir : the artifact folder; replaced if it holds an earlier artifact, refused if it holds anything else
    inputs, outputs : ``TensorSpec`` sequences of the model
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST_NAME).exists())):
        raise ArtifactError(f"refusing to overwrite {out}: it exists and is not a tvmfuse artifact")
    key = signing_key(create=True)  # before anything is written: a key that cannot be made leaves no folder behind
    link = export_options(target)  # likewise: a cross build without its linker is refused before any write
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        result.executable.export_library(str(tmp / LIB_NAME), **link)
        np.savez(tmp / PARAMS_NAME, **{f"param_{i}": p.numpy() for i, p in enumerate(result.lifted_params)})
        manifest = {
            "format": MANIFEST_FORMAT,
            "tvmfuse_version": __version__,
            "tvm_version": tvm_version(),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "target": json.loads(target.canonical),
            "target_kind": target.kind,
            "device": target.device,
            # the machine it runs on (CPU architecture and triple, CUDA arch): `run` refuses it anywhere else
            "machine": target.machine(),
            # the GPU figures its templates' defaults read, and their source (device / table:<arch> / default)
            "device_figures": device_figures(target).to_json() if target.is_gpu else None,
            "model": None if model_path is None else {"name": Path(model_path).name, "sha256": sha256_file(model_path)},
            "planner": planner,
            "inputs": [s.to_json() for s in inputs],
            "outputs": [s.to_json() for s in outputs],
            "num_params": len(result.lifted_params),
            "kernels": [k.to_json() for k in result.kernels],
            "files": {LIB_NAME: sha256_file(tmp / LIB_NAME), PARAMS_NAME: sha256_file(tmp / PARAMS_NAME)},
            **(extra or {}),
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(sign_manifest(manifest, key), indent=2) + "\n")
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
