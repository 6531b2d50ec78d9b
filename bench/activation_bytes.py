"""Activation bytes autograd keeps per layer of the example GPT under recompute none / selective /
full, measured (saved-tensor hooks, unique storages, parameters excluded), beside Korthikanti et
al. 2022's per-layer formulas (fp16 counting): 34sbh + 5as^2b without recomputation, 2sbh with
full recomputation.

    python bench/activation_bytes.py [--batch 2] [--seq 64]

Per layer = (saved bytes of a 4-layer model - of a 2-layer model) / 2, in one process (pp=1), so
embedding, head and loss cancel out."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # for `examples.gpt`

import autopart  # noqa: E402
from examples.gpt import GPT, config, lm_loss  # noqa: E402


def saved_bytes(n_layer: int, mode: str, b: int, s: int) -> int:
    torch.manual_seed(0)
    model = GPT(config(f"tiny,n_layer={n_layer},dropout=0.0,block_size={s}"))
    x = torch.randint(0, 256, (b, s))
    c = autopart.compile(model, autopart.Mesh(), (x,), loss_fn=lm_loss, target=x, recompute=mode)
    chunk = c.programs[0].chunks[0]
    params = {p.untyped_storage().data_ptr() for p in chunk.gm.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunk.gm(x, x)
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    b, s, h, a = args.batch, args.seq, config("tiny").n_embd, config("tiny").n_head
    print(f"example GPT tiny (h={h}, a={a}), b={b}, s={s}, fp32; per layer, bytes")
    print(f"{'recompute':10} {'measured':>10} {'fp16 terms':>11} {'in sbh':>7}   Korthikanti (fp16)")
    formula = {"none": f"34sbh + 5as^2b = {34 * s * b * h + 5 * a * s * s * b}",
               "selective": f"34sbh = {34 * s * b * h}", "full": f"2sbh = {2 * s * b * h}"}
    for mode in ("none", "selective", "full"):
        per = (saved_bytes(4, mode, b, s) - saved_bytes(2, mode, b, s)) / 2
        print(f"{mode:10} {per:>10.0f} {per / 2:>11.0f} {per / 2 / (s * b * h):>7.2f}   "
              f"{formula[mode]}")


if __name__ == "__main__":
    main()
