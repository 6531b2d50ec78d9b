"""autopart.data: the token file, the loader's stream of samples, each rank's share of it, the
bytes a rank reads, its state through pm.save / pm.load (exact resume after a kill, and on
another mesh), and bad inputs.

The expected global batches come from the documented definition (autopart/data/loader.py),
recomputed here from the raw token array (never through the loader or the memory map); the
expected shares are `pm.local_batch` of those global batches; the trained parameters are the
plain model's trained on those global batches.

Fast tier: python -m pytest -m "not full" tests/test_data_loader.py
Everything: python -m pytest tests/test_data_loader.py
"""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from autopart.data import HEADER_BYTES, TokenFile, TokenLoader, write_tokens
from autopart.errors import AutopartError
from autopart.runtime.batches import BatchShard
from tests.workers.data import (assembled, expected_global, local_cut, plain_training, run_ranks,
                                same, shards_of)

SEQ, BATCH, SEED = 16, 8, 3


@pytest.fixture
def corpus(tmp_path):
    """~6 windows of 17 tokens (so a 3-step run crosses an epoch), ids below the model's 128."""
    tokens = np.random.default_rng(0).integers(0, 128, size=6 * SEQ + 5)
    return write_tokens(tmp_path / "c.tokens", tokens), tokens


def test_the_file_round_trips_and_the_stream_is_the_documented_one(corpus):
    path, tokens = corpus
    f = TokenFile(path)
    assert (f.dtype, len(f)) == ("uint16", len(tokens))
    assert path.stat().st_size == HEADER_BYTES + 2 * len(tokens)
    assert np.array_equal(f.read(0, len(tokens)), tokens)
    loader = TokenLoader(path, SEQ, BATCH, seed=SEED)
    for step in range(3):       # 24 samples over 6 windows: four epochs, each its own order
        b = next(loader)
        x, y = expected_global(tokens, SEQ, BATCH, SEED, step)
        assert b.step == step and torch.equal(b.inputs[0], x) and torch.equal(b.target, y)
    big = write_tokens(path.parent / "big.tokens", np.array([0, 70000, 5]))
    assert TokenFile(big).dtype == "uint32" and list(TokenFile(big).read(0, 3)) == [0, 70000, 5]


@pytest.mark.parametrize("mesh", [{"dp": 2}, {"dp": 4}, {"pp": 2, "dp": 2}, {"pp": 3},
                                  {"cp": 2, "dp": 2}, {"tp": 2, "dp": 2}])
def test_each_rank_reads_exactly_its_local_batch(corpus, mesh):
    """Every rank's share is local_batch of the global batch, and its bytes are its rows and
    chunks only: 1/dp of the inputs (plus the targets, one token more a chunk, where read)."""
    path, tokens = corpus
    for rank, shard in enumerate(shards_of(mesh, BATCH, SEQ)):
        loader = TokenLoader(path, SEQ, BATCH, shard=shard, seed=SEED)
        for step in range(2):
            b = next(loader)
            x, y = expected_global(tokens, SEQ, BATCH, SEED, step)
            assert same(b.inputs[0], local_cut(shard, x)), (mesh, rank, step)
            assert same(b.target, local_cut(shard, y, targets=True)), (mesh, rank, step)
        chunk = SEQ // shard.seq_chunks_total
        per_chunk = chunk + 1 if shard.needs_inputs and shard.needs_targets else \
            chunk if shard.needs_inputs or shard.needs_targets else 0
        assert loader.bytes_read == 2 * len(shard.rows) * len(shard.seq_chunks) * per_chunk * 2


def test_loader_state_resumes_the_stream_and_refuses_another(corpus, tmp_path):
    path, tokens = corpus
    a = TokenLoader(path, SEQ, BATCH, seed=SEED)
    next(a), next(a)
    b = TokenLoader(path, SEQ, BATCH, seed=SEED)
    b.load_state_dict(a.state_dict())
    assert torch.equal(next(b).inputs[0], next(a).inputs[0])
    half = TokenLoader(path, SEQ, BATCH // 2, seed=SEED)    # another global batch: same stream
    half.load_state_dict({**a.state_dict(), "global_batch": BATCH})
    x, _ = expected_global(tokens, SEQ, BATCH, SEED, 3)
    assert torch.equal(next(half).inputs[0], x[:BATCH // 2])
    with pytest.raises(AutopartError, match=r"(?s)seed is 3, this one.s is 4.*remedy"):
        TokenLoader(path, SEQ, BATCH, seed=4).load_state_dict(a.state_dict())
    with pytest.raises(AutopartError, match="not a TokenLoader state"):
        b.load_state_dict({"step": 2})


def test_bad_corpora_are_refused_with_the_numbers_and_a_remedy(tmp_path):
    short = write_tokens(tmp_path / "short.tokens", np.arange(10))
    with pytest.raises(AutopartError, match=r"(?s)holds 10 tokens, fewer than one sample of seq \+ 1 "
                                            r"= 17.*remedy: a longer corpus, or seq <= 9"):
        TokenLoader(short, SEQ, BATCH)
    bad = tmp_path / "bad.tokens"
    bad.write_bytes(struct.pack("<8sI12sQ", b"APTOKENS", 1, b"float32", 4) + bytes(16))
    with pytest.raises(AutopartError, match=r"(?s)header says dtype 'float32', not one of .*uint16.*"
                                            r"remedy"):
        TokenFile(bad)
    cut = tmp_path / "cut.tokens"
    cut.write_bytes(short.read_bytes()[:-3])
    with pytest.raises(AutopartError, match=r"says 10 uint16 tokens \(52 bytes.*has 49 bytes"):
        TokenFile(cut)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.arange(40, dtype=np.uint16).tobytes())      # nanoGPT's headerless .bin
    with pytest.raises(AutopartError, match=r"(?s)not an autopart token file.*write_tokens"):
        TokenFile(raw)
    with pytest.raises(AutopartError, match=r"token id 70000 does not fit uint16"):
        write_tokens(tmp_path / "x.tokens", np.array([70000]), dtype="uint16")
    with pytest.raises(AutopartError, match="negative token id"):
        write_tokens(tmp_path / "x.tokens", np.array([-100, 3]))
    assert not (tmp_path / "x.tokens").exists() and not (tmp_path / "x.tokens.part").exists()
    with pytest.raises(AutopartError, match=r"seq=16 does not divide into the 6 sequence chunks"):
        TokenLoader(write_tokens(tmp_path / "ok.tokens", np.arange(100)), SEQ, BATCH,
                    shard=BatchShard(0, (0,), (0, 5), 6, True, True))


# -- on real ranks, against the plain model ------------------------------------------------------

STEPS = 3


def test_training_from_the_loader_on_dp2_matches_the_plain_model(corpus, tmp_path):
    """dp=2, each rank fed only its rows by the loader: the plain model's losses and parameters
    on the global batches, and each rank's batches local_batch of them. Then load(loader=) of a
    checkpoint saved without it, and save(loader=) of loaders that disagree, refused."""
    path, tokens = corpus
    runs = run_ranks(2, dict(corpus=str(path), mesh={"dp": 2}, steps=STEPS,
                             bad_saves=str(tmp_path / "ckpt")), timeout=240)
    plain = plain_training(tokens, STEPS)
    for r in runs:
        r.check_against(plain, tokens)
    half = sum(r.bytes_read for r in runs) / 2
    assert runs[0].bytes_read == runs[1].bytes_read == half     # each rank its own half


@pytest.mark.full     # two spawns, ~70 s
def test_resume_after_a_kill_gives_the_uninterrupted_batches_and_weights(corpus, tmp_path):
    path, tokens = corpus
    ckpt = str(tmp_path / "ckpt")
    spec = dict(corpus=str(path), mesh={"dp": 2}, steps=STEPS + 2, save_at=2, ckpt=ckpt,
                die_after=3)
    with pytest.raises(RuntimeError, match="ranks failed"):      # rank 1 dies after step 3
        run_ranks(2, spec, timeout=240, pg_timeout=20)
    runs = run_ranks(2, dict(spec, load=ckpt, save_at=None, die_after=None), timeout=240)
    plain = plain_training(tokens, STEPS + 2)
    for r in runs:
        assert r.first_step == 2, "resumed at the step after the checkpoint"
        r.check_against(plain, tokens)


@pytest.mark.full     # four spawns, ~90 s
def test_resume_on_another_mesh_keeps_the_global_stream(corpus, tmp_path):
    """Saved at dp=2, resumed at pp=2 (each rank another share: inputs only, targets only), at
    cp=2 (each rank two sequence chunks of every row) and at dp=1: the global batches and
    weights of the uninterrupted plain run."""
    path, tokens = corpus
    ckpt = str(tmp_path / "ckpt")
    run_ranks(2, dict(corpus=str(path), mesh={"dp": 2}, steps=2, save_at=2, ckpt=ckpt),
              timeout=240)
    plain = plain_training(tokens, STEPS + 1)
    for mesh, world in (({"pp": 2}, 2), ({"cp": 2}, 2), ({"dp": 1}, 1)):
        runs = run_ranks(world, dict(corpus=str(path), mesh=mesh, steps=STEPS + 1, load=ckpt),
                         timeout=240)
        for r in runs:
            assert r.first_step == 2
            r.check_against(plain, tokens)


@pytest.mark.full     # three spawns of 4, 2 and 4 ranks
def test_a_dp4_checkpoint_resumes_exactly_on_dp2_and_pp2_x_dp2(corpus, tmp_path):
    """dp=4 (each rank 2 of the 8 rows) trains 4 steps, saving after step 2 (loader included);
    resumed from that save at dp=2 and at pp=2 x dp=2, steps 2 and 3 have the uninterrupted
    run's global batches (put back together from the ranks' shares), which are the documented
    stream's, and the same losses and weights as the uninterrupted run and as the plain model
    trained on those global batches."""
    path, tokens = corpus
    ckpt, steps = str(tmp_path / "ckpt"), STEPS + 1
    spec = dict(corpus=str(path), steps=steps)
    whole = run_ranks(4, dict(spec, mesh={"dp": 4}, save_at=2, ckpt=ckpt), timeout=300)
    plain = plain_training(tokens, steps)
    uninterrupted = assembled(whole)
    assert sorted(uninterrupted) == list(range(steps))
    for step, (x, y) in uninterrupted.items():
        want = expected_global(tokens, SEQ, BATCH, SEED, step)
        assert torch.equal(x, want[0]) and torch.equal(y, want[1]), step
    for r in whole:
        assert len(r.shard.rows) == 2
        r.check_against(plain, tokens)
    for mesh, world in (({"dp": 2}, 2), ({"pp": 2, "dp": 2}, 4)):
        runs = run_ranks(world, dict(spec, mesh=mesh, load=ckpt), timeout=300)
        resumed = assembled(runs)
        assert sorted(resumed) == [2, 3], (mesh, sorted(resumed))
        for step, (x, y) in resumed.items():
            assert torch.equal(x, uninterrupted[step][0]), (mesh, step, "inputs")
            assert torch.equal(y, uninterrupted[step][1]), (mesh, step, "targets")
        for r in runs:
            assert r.first_step == 2, (mesh, r.rank)
            r.check_against(plain, tokens)
            r.check_same_as(whole[0])


@pytest.mark.full     # two runs of the example, ~80 s
def test_the_example_trains_saves_and_resumes_on_another_mesh(tmp_path):
    """README's commands: examples/train_llama.py writes its corpus, trains dp=2 (each rank half
    the bytes), saves; resumed at pp=2 it goes on at the next step, the plain model's losses."""
    import subprocess
    import sys
    from pathlib import Path
    example = Path(__file__).resolve().parent.parent / "examples" / "train_llama.py"
    corpus, ckpt = str(tmp_path / "c.tokens"), str(tmp_path / "ckpt")

    def run(*args) -> str:
        out = subprocess.run([sys.executable, str(example), "--corpus", corpus, *args],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        worst = [ln for ln in out.stdout.splitlines() if ln.startswith("largest loss")][0]
        assert float(worst.split(":")[1]) < 1e-5, worst
        return out.stdout
    first = run("--make-corpus", "--steps", "3", "--save", ckpt)
    assert first.count("(0.50 of the global batches'); rows 4/8") == 2, first
    resumed = run("--resume", ckpt, "--steps", "5", "--mesh", "pp=2")
    assert "at step 3" in resumed and "step   3" in resumed and "step   2" not in resumed
    assert "inputs yes, targets no" in resumed and "inputs no, targets yes" in resumed
