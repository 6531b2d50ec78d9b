"""The model-families table of docs/families.md: each family compiled (with the fake-tensor program
check) for pp, tp, tp + sequence parallelism and ep, then trained for 3 steps on 2 spawned Gloo
ranks against the unmodified model (tests/workers/equivalence.equivalence). Prints a
markdown table.

    python bench/families.py                  # compile and train every cell (several minutes)
    python bench/families.py --compile-only   # compile and check only (about a minute)
    python bench/families.py --only bert,vit
"""
from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import torch  # noqa: E402

# family -> (description, model name in tests/workers/common.build or tests/workers/family)
FAMILIES = {
    "GPT (examples/gpt.py, nanoGPT style)": "gpt4",
    "Hugging Face GPT-2 (Conv1D, fused qkv)": "hf",
    "Meta-Llama style (examples/llama_meta.py: complex RoPE, RMSNorm by hand, SwiGLU)": "llama-meta",
    "Meta-Llama style, grouped-query attention": "llama-gqa",
    "GPT-NeoX / BLOOM style (examples/neox.py: parallel blocks, interleaved qkv, ALiBi)": "neox",
    "Hugging Face BERT (encoder-only, masked LM)": "bert",
    "Hugging Face BART (encoder-decoder)": "bart",
    "Hugging Face ViT (image classification)": "vit",
    "Switch MoE (examples/switch.py)": "switch",
    "Hugging Face Mixtral (sorted-rows MoE)": "mixtral",
}
COLUMNS = {"pp": dict(pp=2, microbatches=2), "tp": dict(tp=2), "sp": dict(tp=2, sp=True),
           "ep": dict(dp=2, ep=2)}


def _case(model: str, column: str):
    from tests.workers.common import Case
    opts = dict(COLUMNS[column])
    sp = opts.pop("sp", False)
    return Case(f"{model}-{column}", model=model, sequence_parallel=sp, **opts)


def compile_cell(model: str, column: str) -> str:
    """'' when the case compiles (and its programs pass the check), else the error's first line."""
    import autopart
    from tests.workers.common import build
    import tests.workers.family  # noqa: F401  (registers the families with build)
    case = _case(model, column)
    net, loss_fn, inputs, target = build(case)
    mesh = autopart.Mesh(pp=case.pp, dp=case.dp, tp=case.tp, ep=case.ep)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            autopart.compile(net, mesh, inputs, loss_fn=loss_fn, target=target,
                             microbatches=case.microbatches,
                             sequence_parallel=case.sequence_parallel)
    except autopart.AutopartError as e:
        first = re.sub(r"^pass \S+ \(.*?\) failed: ", "", str(e).splitlines()[0])
        return first if len(first) <= 110 else first[:first.rfind(" ", 0, 107)] + " ..."
    return ""


def train_cell(model: str, column: str) -> str:
    from autopart.runtime.launch import spawn
    from tests.workers.family import run_family_cases
    case = _case(model, column)
    try:
        per_rank = spawn(run_family_cases, case.world, [case], timeout=600, pg_timeout=120)
    except Exception as e:  # noqa: BLE001
        return f"failed: {type(e).__name__}"
    problems = [p for rank in per_rank for r in rank for p in r["problems"]]
    return "yes" if not problems else f"differs: {problems[0][:80]}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--only", default=None, help="comma-separated model names")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    only = set(args.only.split(",")) if args.only else None
    print("| family | " + " | ".join(COLUMNS) + " |")
    print("| --- |" + " --- |" * len(COLUMNS))
    for title, model in FAMILIES.items():
        if only and model not in only:
            continue
        cells = []
        for column in COLUMNS:
            error = compile_cell(model, column)
            if error:
                cells.append(f"no: {error}")
            elif args.compile_only:
                cells.append("compiles")
            else:
                cells.append(train_cell(model, column))
        print(f"| {title} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
