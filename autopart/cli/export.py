"""`autopart export CHECKPOINT OUT`: a sharded checkpoint as the plain model's safetensors.

    autopart export ckpt/step1000 out/                   # out/model.safetensors (+ config.json)
    autopart export ckpt/step1000 model.safetensors      # one file

Runs in one process without a process group, whatever mesh saved the checkpoint: every tensor is
reassembled from its shards at their global offsets, under every key the plain model's
`state_dict()` has (a tied weight under each of its names), so the unmodified model loads it with
`load_state_dict(load_file(...), strict=True)`. When the checkpoint was saved with `model=` a
Hugging Face model (one with a `config.to_dict()`), OUT is a model directory (config.json +
model.safetensors) that `AutoModelForCausalLM.from_pretrained(OUT)` loads.
"""
from __future__ import annotations

import argparse
import sys
import time

from autopart.errors import AutopartError
from autopart.cli.parsers import documented_parser


def add_export_command(subparsers) -> argparse.ArgumentParser:
    """Register `export` on an argparse subparsers object; `args.run(args)` carries it out."""
    p = documented_parser(subparsers, "export", "write a checkpoint as the plain model's "
                          "safetensors (or a HF model dir)", __doc__)
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a directory written by pm.save")
    p.add_argument("out", metavar="OUT",
                   help="a directory (gets model.safetensors) or a path ending in .safetensors")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the CRC-32 check of every checkpoint file (sizes are still checked)")
    p.set_defaults(run=run_export)
    return p


def run_export(args: argparse.Namespace) -> int:
    """Run `autopart export` for parsed `args`; returns the exit code (2 on a bad checkpoint)."""
    from autopart.runtime import checkpoint

    start = time.perf_counter()
    try:
        files = checkpoint.export(args.checkpoint, args.out, verify=not args.no_verify)
    except AutopartError as e:
        print(f"autopart export: error: {e}", file=sys.stderr)
        return 2
    marker = checkpoint.read_marker(args.checkpoint)
    print(f"{args.checkpoint}: {checkpoint.summary(marker)}")
    for f in files:
        print(f"wrote {f} ({f.stat().st_size / 2**20:.1f} MiB)")
    print(f"export time: {time.perf_counter() - start:.2f} s")
    return 0
