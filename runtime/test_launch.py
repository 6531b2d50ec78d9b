"""One device discipline (issue 33, rows 2, 3 and 6), checked on a CPU machine: a rank's device
comes from LOCAL_RANK (cuda:LOCAL_RANK when CUDA is used), the backend follows the device the
caller chose, never the count of GPUs, set_device precedes NCCL's process group, meta models
materialize on the rank's device, and the cross-rank program digest ignores device indices."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopart
from autopart import api
from autopart.runtime import launch
from tests.workers.common import Case, build


def test_rank_device_follows_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert launch.rank_device("cuda") == torch.device("cuda", 3)
    assert launch.rank_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert launch.rank_device("cuda:1") == torch.device("cuda", 1)     # explicit: as given
    assert launch.rank_device("cpu") == torch.device("cpu")
    assert launch.backend_for("cuda:3") == "nccl" and launch.backend_for("cpu") == "gloo"


@pytest.mark.parametrize("backend,expected", [("nccl", torch.device("cuda", 5)),
                                              ("cpu:gloo,cuda:nccl", torch.device("cuda", 5)),
                                              ("gloo", torch.device("cpu"))])
def test_meta_models_materialize_on_the_backends_device(monkeypatch, backend, expected):
    """parallelize's device for a meta-device model: the one rank_device() gives, cuda:LOCAL_RANK
    under NCCL (it was current_device(): GPU 0 on every rank unless the user had set one)."""
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    with autopart.meta_device():
        model = torch.nn.Linear(4, 4)
    assert api._device_of(model) == expected
    assert launch.rank_device() == expected


def test_init_process_group_sets_the_device_before_nccl(monkeypatch):
    calls = []
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend)))
    assert launch.init_process_group("cuda") == torch.device("cuda", 2)
    assert calls == [("set_device", torch.device("cuda", 2)), ("init", "nccl")]
    calls.clear()
    assert launch.init_process_group() == torch.device("cpu")
    assert calls == [("init", "gloo")]


def _backend(rank, world):
    return dist.get_backend()


def test_a_cpu_caller_gets_gloo_on_a_machine_with_gpus(monkeypatch):
    """spawn's rank setup on an 8-GPU machine (faked) for callers that build CPU models: Gloo.
    It chose NCCL whenever there were at least `world` GPUs ("No backend type associated with
    device type cpu" at the first collective)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "OMP_NUM_THREADS"):
        monkeypatch.setenv(key, "0")          # _worker sets them: restored after the test
    threads = torch.get_num_threads()
    results: dict = {}
    try:
        launch._worker(0, 1, launch.free_port(), _backend, (), results, 30.0)
    finally:
        torch.set_num_threads(threads)
    assert results[0] == ("ok", "gloo")


def test_spawn_on_cuda_needs_a_gpu_per_rank():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    with pytest.raises(RuntimeError, match="needs 2 GPUs"):
        launch.spawn(_backend, 2, device="cuda", timeout=30)


def _on_device(compiled, device: torch.device) -> None:
    """Rewrite every chunk program as compiled for `device` (what rank r on cuda:r compiles)."""
    for chunk in compiled.program.chunks:
        for node in chunk.gm.graph.nodes:
            if isinstance(node.kwargs.get("device"), torch.device):
                node.update_kwarg("device", device)
        chunk.gm.recompile()


def test_program_digest_ignores_device_indices():
    """Ranks on cuda:0..7 compile the same program; the chunk code prints each rank's index
    (`arange(..., device=device(type='cuda', index=r))`): the digest must not see it."""
    case = Case("digest", model="gpt4", pp=2, microbatches=2)
    model, loss_fn, inputs, target = build(case)
    compiled = autopart.compile(model, autopart.Mesh(pp=2), inputs, loss_fn=loss_fn,
                                target=target, microbatches=2)
    on_cpu = compiled.digest()
    digests = {}
    for index in (0, 3, 7):
        _on_device(compiled, torch.device("cuda", index))
        assert any(f"index={index})" in c.code for c in compiled.program.chunks), \
            "the program prints no device: the test would prove nothing"
        digests[index] = compiled.digest()
    assert len(set(digests.values())) == 1, digests
    assert on_cpu != digests[0], "the device type is still part of the program"
