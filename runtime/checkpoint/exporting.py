"""One process, no group: the plain model's state dict from a checkpoint, as safetensors."""
from __future__ import annotations

import json
import os
import shutil
import torch
import torch.distributed.checkpoint as dcp
import warnings
from autopart.errors import AutopartError
from pathlib import Path
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .checks import _read_marker, _resolve, check_files
from .loading import _read_metadata
from .planners import _LoadPlanner

# -- export ----------------------------------------------------------------------------------------

def read_full_state_dict(path: str | os.PathLike, *, verify: bool = True
                         ) -> tuple[dict[str, torch.Tensor], dict]:
    """The plain model's full state dict from a checkpoint, in one process (no process group):
    (state dict under every key the plain model's state_dict has, aliases included; marker)."""
    path = _resolve(Path(path).absolute())
    marker = _read_marker(path)
    problems = check_files(path, marker, list(marker["files"]) if verify else [])
    if problems:
        raise AutopartError(f"checkpoint {path} is corrupt or incomplete:\n  "
                            + "\n  ".join(problems))
    reader = dcp.FileSystemReader(str(path))
    saved = _read_metadata(reader, path).state_dict_metadata
    tensors = marker["model"]["tensors"]
    full = {}
    for name in tensors:
        md = saved.get(f"model/{name}")
        if not isinstance(md, TensorStorageMetadata):
            raise AutopartError(f"checkpoint {path} is corrupt: no tensor model/{name}")
        full[f"model/{name}"] = torch.empty(md.size, dtype=md.properties.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # "torch.distributed is disabled...": intended
        try:
            dcp.load(full, storage_reader=reader, planner=_LoadPlanner(), no_dist=True)
        except Exception as e:
            raise AutopartError(f"checkpoint {path} could not be read ({type(e).__name__}: "
                                f"{str(e)[:400]})") from e
    canon = {a: n for n, v in tensors.items() for a in (n, *v["aliases"])}
    out = {}
    for key in marker["model"]["state_dict_keys"]:
        name = canon.get(key, key)
        t = full[f"model/{name}"]
        out[key] = t if key == name or name not in tensors else t.clone()
    return out, marker


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, *, verify: bool = True
           ) -> list[Path]:
    """Write the plain model's state dict as safetensors: `out` itself when it ends in
    .safetensors, else `out/model.safetensors` (with `out/config.json` for a Hugging Face model,
    a directory `from_pretrained` loads). Returns the files written."""
    from safetensors.torch import save_file

    out = Path(out)
    target = out if out.suffix == ".safetensors" else out / "model.safetensors"
    _check_writable(target)                      # before the (possibly long) read
    state, marker = read_full_state_dict(checkpoint, verify=verify)
    files = {target: None}
    hf = marker.get("hf")
    if hf is not None and target.parent == out:
        config = dict(hf["config"])
        config["architectures"] = config.get("architectures") or [hf["class"]]
        files[out / "config.json"] = json.dumps(config, indent=2, sort_keys=True)
    meta = {"format": "pt", "autopart_checkpoint": str(Path(checkpoint).absolute()),
            "mesh": json.dumps(marker["mesh"])}
    made = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    temps = {}
    try:   # each file under a temporary name, renamed only when all are written: a failure writes nothing
        for path, text in files.items():
            temps[path] = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            if text is None:
                save_file({k: v.contiguous() for k, v in state.items()}, str(temps[path]), metadata=meta)
            else:
                temps[path].write_text(text)
            # safetensors creates its file 0600; an exported model is meant to be shared like
            # any file the user writes: the usual mode, 0666 less the umask
            os.chmod(temps[path], 0o666 & ~_umask())
        for path, temp in temps.items():
            os.replace(temp, path)
    except BaseException:
        for temp in temps.values():
            temp.unlink(missing_ok=True)
        for d in made:                           # innermost first
            shutil.rmtree(d, ignore_errors=True)
        raise
    return list(files)


def _check_writable(target: Path) -> None:
    """Refuse an OUT that cannot receive `target`, naming why, before anything is read."""
    if target.is_dir():
        raise AutopartError(f"export: {target} is a directory; give a path ending in .safetensors that is "
                            "not one, or a directory to hold model.safetensors")
    parent = next(p for p in (target.parent, *target.parent.parents) if p.exists())
    if not parent.is_dir():
        raise AutopartError(f"export: {parent} is a file, so {target} cannot be written under it; give a "
                            "directory or a path ending in .safetensors")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise AutopartError(f"export: cannot write under {parent} (permission denied); choose another OUT")


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it (/proc), else by
    setting and restoring it (the only portable way)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def read_marker(path: str | os.PathLike) -> dict:
    """The completion marker of the checkpoint at `path` (AutopartError if there is none)."""
    return _read_marker(_resolve(Path(path).absolute()))


def summary(marker: dict) -> str:
    """One line about a checkpoint: mesh, tensors, bytes."""
    total = sum(f["bytes"] for f in marker["files"].values())
    mesh = ",".join(f"{k}={v}" for k, v in marker["mesh"].items() if v > 1) or "pp=1"
    return (f"{len(marker['model']['tensors'])} tensors, {total / 2**20:.1f} MiB in "
            f"{len(marker['files'])} files, saved on {mesh}"
            + (f" with {marker['optimizer']} state" if marker.get("optimizer") else ""))
