"""autopart's tensor-parallel program against DTensor's parallelize_module, on the same model.

    python bench/tp_vs_dtensor.py                    # table
    python bench/tp_vs_dtensor.py --steps 20 --json

Two rank processes (Gloo, one thread each). The model is a Llama-style decoder (separate q, k, v
projections, SwiGLU MLP, RMSNorm; Hugging Face's LlamaForCausalLM built from a config with random
weights), because that is the layout torch's tensor-parallel tutorial writes its hand plan for:
q/k/v, gate and up ColwiseParallel, o and down RowwiseParallel, the embedding RowwiseParallel and
the output projection ColwiseParallel gathering the logits.

Per step each side runs forward + backward + an SGD step on the same global batch; the two sides
alternate step by step in one run so the machine's noise hits both alike, and the table gives
median step times and the ratio autopart/DTensor (the median of per-round ratios); a third side,
autopart with overlap=False (passes/overlap_collectives.py off), shows what the overlap gains. A
fourth, autopart's own floor, runs the same rank programs with every tensor-parallel collective
skipped (each TPComm shape_only: outputs of the right shape, no data moved): the lowest autopart's
step could read if all of its tp communication were hidden, which bounds what any overlap can buy.
Before timing, the first-step losses of DTensor and of autopart with and without the overlap are
checked against the plain model (the floor's loss is wrong by design; it is checked finite).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def make_model(layers: int, hidden: int, seed: int = 0):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden,
                                   intermediate_size=hidden * 8 // 3 // 16 * 16,
                                   num_attention_heads=hidden // 32, num_key_value_heads=hidden // 32,
                                   vocab_size=1024, max_position_embeddings=256, use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def loss_fn(out, target):
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def dtensor_model(model, tp: int):
    """torch's documented hand plan for a Llama-style model, on a 1-D tp mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (tp,))   # Gloo: the process group's backend
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    return model


def run(rank: int, world: int, args) -> dict:
    import autopart
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 1024, (args.batch, args.seq), generator=g)
    y = torch.randint(0, 1024, (args.batch, args.seq), generator=g)

    plain = make_model(args.layers, args.hidden)
    with torch.no_grad():
        ref_loss = loss_fn(plain(x), y).item()

    ours = autopart.parallelize(make_model(args.layers, args.hidden), autopart.Mesh(tp=world),
                                (x,), loss_fn=loss_fn, target=y)
    our_opt = torch.optim.SGD(ours.parameters(), lr=1e-3)
    # the same program without passes/overlap_collectives (its backward all-reduces in series)
    serial = autopart.parallelize(make_model(args.layers, args.hidden), autopart.Mesh(tp=world),
                                  (x,), loss_fn=loss_fn, target=y, overlap=False)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=1e-3)

    floor = autopart.parallelize(make_model(args.layers, args.hidden), autopart.Mesh(tp=world),
                                 (x,), loss_fn=loss_fn, target=y)
    _skip_tp_collectives(floor)
    floor_opt = torch.optim.SGD(floor.parameters(), lr=1e-3)

    theirs = dtensor_model(make_model(args.layers, args.hidden), world)
    their_opt = torch.optim.SGD(theirs.parameters(), lr=1e-3)

    def step_of(pm, opt):
        def step():
            loss = pm.train_step(x, target=y)
            opt.step()
            opt.zero_grad()
            return float(loss)
        return step
    ours_step, serial_step = step_of(ours, our_opt), step_of(serial, serial_opt)
    floor_step = step_of(floor, floor_opt)

    def theirs_step():
        loss = loss_fn(theirs(x), y)
        loss.backward()
        their_opt.step()
        their_opt.zero_grad()
        return float(loss)

    first = {"plain": ref_loss, "autopart": ours_step(), "dtensor": theirs_step(),
             "autopart_no_overlap": serial_step(), "autopart_floor": floor_step()}
    times = {"autopart": [], "dtensor": [], "autopart_no_overlap": [], "autopart_floor": []}
    for _ in range(args.warmup):
        ours_step(), theirs_step(), serial_step(), floor_step()
    for _ in range(args.steps):
        for name, fn in (("autopart", ours_step), ("dtensor", theirs_step),
                         ("autopart_no_overlap", serial_step), ("autopart_floor", floor_step)):
            torch.distributed.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {"first_loss": first, "times": times,
            "params": {"autopart": sum(p.numel() for p in ours.parameters()),
                       "plain": sum(p.numel() for p in plain.parameters())}}


def _skip_tp_collectives(pm) -> None:
    """Make every tensor-parallel collective of `pm`'s programs a no-op of the right shape (the
    compile-time checker's shape_only mode): what is left is autopart's own compute and step."""
    from autopart.ops.tp import TPComm
    comms = [m for c in pm.program.chunks for m in c.gm.modules() if isinstance(m, TPComm)]
    assert comms, "the floor must skip the tp collectives"
    for m in comms:
        m.shape_only = True


def _per_round(a: list, b: list) -> float:
    """The median of step-by-step ratios: each round's sides ran back to back."""
    return statistics.median(x / y for x, y in zip(a, b))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    from autopart.runtime.launch import spawn
    out = spawn(run, 2, args, timeout=args.timeout)[0]
    first = out["first_loss"]
    ok = all(abs(first[k] - first["plain"]) < 1e-4 for k in ("autopart", "dtensor",
                                                              "autopart_no_overlap")) \
        and math.isfinite(first["autopart_floor"])
    med = {k: statistics.median(v) for k, v in out["times"].items()}
    t = out["times"]
    ratio = _per_round(t["autopart"], t["dtensor"])
    serial = _per_round(t["autopart_no_overlap"], t["dtensor"])
    gain = _per_round(t["autopart"], t["autopart_no_overlap"])
    floor = _per_round(t["autopart_floor"], t["dtensor"])
    result = {"tp": 2, "model": f"Llama {args.layers} layers, hidden {args.hidden}, "
              f"batch {args.batch}x{args.seq}", "first_step_loss": first, "losses_match": ok,
              "median_step_seconds": med, "ratio_autopart_over_dtensor": ratio,
              "ratio_no_overlap_over_dtensor": serial, "ratio_overlap_over_no_overlap": gain,
              "ratio_own_floor_over_dtensor": floor,
              "autopart_param_share": out["params"]["autopart"] / out["params"]["plain"],
              "step_seconds": out["times"]}     # rank 0's, step by step (the sides alternate)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"tensor parallelism, tp=2, Gloo, 1 thread per rank: {result['model']}")
        print(f"first-step loss: plain {first['plain']:.6f}  autopart {first['autopart']:.6f}  "
              f"DTensor {first['dtensor']:.6f}  ({'match' if ok else 'MISMATCH'})")
        print(f"median step (fwd+bwd+SGD): autopart {med['autopart'] * 1e3:.1f} ms   "
              f"DTensor {med['dtensor'] * 1e3:.1f} ms")
        print(f"  autopart with overlap=False {med['autopart_no_overlap'] * 1e3:.1f} ms   "
              f"autopart's own floor (no tp collectives) {med['autopart_floor'] * 1e3:.1f} ms")
        print(f"ratio autopart/DTensor: {ratio:.3f}   overlap=False/DTensor: {serial:.3f}   "
              f"overlap/overlap=False: {gain:.3f}   own floor/DTensor: {floor:.3f}   "
              "(medians of per-round ratios)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
