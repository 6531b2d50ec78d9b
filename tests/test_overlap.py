"""The data-parallel gradient reduction overlapped with the backward (runtime/gradients.py), on
real processes, with buckets small enough (tests/workers/overlap.py SMALL_BUCKET) to cut the
test GPT into several:

- the run still equals the plain model (losses, step-1 gradients, clipped norm, parameters);
- a train_step and clip_grad_norm_ read one device value on the host, none for the gradients:
  the reduced [loss, non-finite flags, ids out of range] (runtime/state.py step_results: the step
  must know before the optimizer runs), under nonfinite="raise" (the default) and "ignore" alike
  (the test GPT's input indexes an embedding, whose ids' range is read there in every mode);
  before the step the ranks agree on host values only (runtime/batches.py agree: whether a rank
  refused its tensors, the sequence length; one tolist of a CPU tensor over the CPU group,
  host_sum), and the token count stays on the device;
- the trace shows a bucket's all-reduce posted before the rank's last backward action ended,
  with pp=1 (posted from autograd's hook inside the one fused backward) and with pp=2; and
  ZeRO's reduce-scatter likewise (zero=2 at dp=2, zero=1 at pp=2 x dp=2).
"""
from __future__ import annotations

from collections import defaultdict
from functools import partial

import pytest

from autopart.cli.timeline import trace_slices
from tests.workers.common import Case
from tests.workers.equivalence import assert_all_ranks_equal_plain, run_group
from tests.composition import CCase
from tests.workers.overlap import overlap_cases

M = dict(model="gpt4", microbatches=2)
CASES_2 = [Case("overlap-gpt4-dp2", dp=2, **M),
           CCase("overlap-gpt4-dp2-zero2", dp=2, zero=2, **M)]
CASES_4 = [Case("overlap-gpt4-pp2xdp2-1f1b", pp=2, dp=2, **M),
           Case("overlap-gpt4-pp2xdp2-zb-v", pp=2, dp=2, schedule="zb-v", virtual_stages=2, **M),
           CCase("overlap-gpt4-pp2xdp2-zero1", pp=2, dp=2, zero=1, **M)]
GROUPS = {("overlap", 2): CASES_2, ("overlap", 4): CASES_4}
_GROUP_OF = {c.name: key for key, cases in GROUPS.items() for c in cases}
CASES = [pytest.param(c, id=c.name) for c in CASES_2 + CASES_4]

# the ranks' agreement on host values before the step (runtime/batches.py agree: whether a rank
# refused its tensors, the sequence length), a CPU tensor over the CPU group: no device value
HOST_AGREEMENT = "tolist at batches.py (host_sum)"
# the step's one read of a device value: the reduced [loss, flags, ids out of range]; with
# nonfinite="ignore" too, as the ids' range is read in every mode
EXPECTED_SYNCS = [HOST_AGREEMENT, "tolist at state.py (step_results)"]
DEFAULT_SYNCS = EXPECTED_SYNCS


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("overlap")


def _results(case: Case, cache: dict, trace_dir) -> list[dict]:
    key = _GROUP_OF[case.name]
    results = run_group(cache, key, GROUPS[key], rank_fn=partial(overlap_cases,
                                                                 trace_dir=str(trace_dir)))
    ranks = results[case.name]
    assert_all_ranks_equal_plain(case, ranks)
    return ranks


@pytest.mark.parametrize("case", CASES)
def test_equals_plain_model_with_small_buckets(case, spawn_cache, trace_dir):
    ranks = _results(case, spawn_cache, trace_dir)
    assert all(r["buckets"] > 2 for r in ranks), [r["buckets"] for r in ranks]


@pytest.mark.parametrize("case", CASES)
def test_host_syncs_are_the_host_agreement_and_the_one_step_read(case, spawn_cache, trace_dir):
    for r in _results(case, spawn_cache, trace_dir):
        for key, expected in (("syncs_default", DEFAULT_SYNCS), ("syncs", EXPECTED_SYNCS)):
            where = [s.split(":")[0] + " " + s.split(" ")[-1] for s in r[key]]   # no line
            assert sorted(where) == sorted(expected), f"rank {r['rank']} {key}: {r[key]}"


@pytest.mark.parametrize("case", CASES)
def test_a_bucket_is_posted_before_the_backward_ends(case, spawn_cache, trace_dir):
    events = next(r for r in _results(case, spawn_cache, trace_dir) if r["rank"] == 0)["events"]
    complete = [e for e in events if e["ph"] == "X"]
    last_backward_end, first_post = defaultdict(float), {}
    for e in complete:
        key = (e["pid"], e["args"]["step"])
        if e["args"]["kind"] in ("B", "W"):
            last_backward_end[key] = max(last_backward_end[key], e["ts"] + e["dur"])
        elif e["args"]["kind"] == "REDUCE":
            assert e["tid"] == 1 and e["args"]["wait_us"] >= e["args"]["posted_us"], e
            first_post[key] = min(first_post.get(key, float("inf")), e["args"]["posted_us"])
    keys = {(rank, step) for rank in range(case.world) for step in range(2)}
    assert set(first_post) == keys and set(last_backward_end) == keys
    early = {k: last_backward_end[k] - first_post[k] for k in sorted(keys)}
    assert all(us > 0 for us in early.values()), f"first post, us before the backward's end: {early}"
    # the drawing leaves the reductions out
    drawn = trace_slices({"traceEvents": events})
    assert len(drawn) == sum(e["args"]["kind"] != "REDUCE" for e in complete)
