"""Checks on load: the marker, the files' sizes and CRC-32, the same model."""
from __future__ import annotations

import json
import zlib
import torch.distributed as dist
import warnings
from autopart.errors import AutopartError
from pathlib import Path

from .geometry import FORMAT, MARKER, _OLD, _TMP
from .held import _describe_model, _digest

# -- checks on load --------------------------------------------------------------------------------

def _resolve(path: Path) -> Path:
    """`path`, or the previous checkpoint a save moved aside just before it died (rank 0 killed
    between its two renames)."""
    if path.exists():
        return path
    aside = sorted(path.parent.glob(f".{path.name}{_OLD}*"), key=lambda p: p.stat().st_mtime)
    for old in reversed(aside):
        if (old / MARKER).exists():
            warnings.warn(f"no checkpoint at {path}; loading the previous one, moved aside to "
                          f"{old} by a save that did not finish", stacklevel=3)
            return old
    return path


def _read_marker(path: Path) -> dict:
    if not path.is_dir():
        tmp = sorted(path.parent.glob(f".{path.name}{_TMP}*"))
        hint = f" (an unfinished save left {tmp[-1]})" if tmp else ""
        raise AutopartError(f"no checkpoint at {path}: not a directory{hint}")
    f = path / MARKER
    if not f.exists():
        raise AutopartError(f"checkpoint {path} is incomplete: its completion marker {MARKER} is "
                            "missing (a save that did not finish, or not an autopart checkpoint)")
    try:
        marker = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise AutopartError(f"checkpoint {path}: the completion marker {MARKER} is corrupt "
                            f"({type(e).__name__}: {e})") from e
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise AutopartError(f"checkpoint {path}: {MARKER} is not a format-{FORMAT} autopart marker")
    return marker


def check_files(path: Path, marker: dict, which: list[str] | None = None) -> list[str]:
    """Problems with the checkpoint's files: missing, wrong size, CRC mismatch (for `which`)."""
    problems = []
    for name, rec in sorted(marker["files"].items()):
        f = path / name
        if not f.exists():
            problems.append(f"file {name} is missing")
        elif f.stat().st_size != rec["bytes"]:
            problems.append(f"file {name} has {f.stat().st_size} bytes, {rec['bytes']} were "
                            "written (truncated or overwritten)")
        elif which is not None and name in which and _file_record(f)["crc32"] != rec["crc32"]:
            problems.append(f"file {name} is corrupt (CRC-32 differs from the one saved)")
    return problems


def model_group(pm):
    """The group save and load run their collectives on: the model's world group, made with
    parallelize's timeout, so a rank stuck in DCP fails the others within that timeout rather
    than the default group's (30 minutes by torch's default). None (the default group) for a
    model without groups or a single process."""
    groups = getattr(pm, "_groups", None)
    return getattr(groups, "world", None)


def _verify(path: Path, marker: dict, rank: int, world: int, distributed: bool,
            group=None) -> None:
    """Every rank checks every file's size and the checksums of its share of the files."""
    names = sorted(marker["files"])
    mine = [n for i, n in enumerate(names) if i % world == rank]
    problems = check_files(path, marker, mine)
    if distributed:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, problems, group=group)
        problems = sorted({p for part in gathered for p in part})
    if problems:
        raise AutopartError(f"checkpoint {path} is corrupt or incomplete:\n  "
                            + "\n  ".join(problems))


def _check_same_model(pm, marker: dict, path: Path) -> None:
    saved = marker["model"]["tensors"]
    mine = _describe_model(pm)["tensors"]
    if marker["model"]["digest"] == _digest(mine):
        return
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    differ = [f"{n}: saved {tuple(saved[n]['shape'])} {saved[n]['dtype']}, model "
              f"{tuple(mine[n]['shape'])} {mine[n]['dtype']}"
              for n in sorted(set(saved) & set(mine))
              if (saved[n]["shape"], saved[n]["dtype"]) != (mine[n]["shape"], mine[n]["dtype"])]
    lines = []
    for title, items in (("missing from the checkpoint", missing),
                         ("in the checkpoint but not in the model", unexpected),
                         ("with different shapes or dtypes", differ)):
        if items:
            shown = items[:8] + ([f"... and {len(items) - 8} more"] if len(items) > 8 else [])
            lines.append(f"{len(items)} tensors {title}: " + "; ".join(shown))
    raise AutopartError(f"checkpoint {path} is of a different model "
                        f"({marker.get('model_class', 'class not recorded')}):\n  "
                        + "\n  ".join(lines))


def _file_record(f: Path) -> dict:
    crc = 0
    with open(f, "rb") as stream:
        while block := stream.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return {"bytes": f.stat().st_size, "crc32": crc}
