"""What each rank holds, against the plain model (tests/test_equivalence.py,
tests/test_tensor_parallel.py): computed from the plain model's parameter sizes and the names the
rank's chunk graphs read, never from the run's own parameter counts."""
from __future__ import annotations

from tests.workers.common import Case, build


def assert_rank_shares(case: Case, ranks: list[dict]) -> None:
    """A rank holds exactly the parameters the graphs of its chunks read (get_attr names, from
    tests/workers/equivalence.equivalence's "read"), each at the plain model's size, 1/tp of it for
    a tensor-parallel shard and 1/ep for experts; each untied parameter is held by one pipeline
    stage; no rank holds every element (with pp > 1 or tp > 1); ranks hold chunks r, r+pp, ...
    (r and 2pp-1-r for a V schedule)."""
    assert all("held_numel" in r for r in ranks), "the case failed: see test_matches_plain_model"
    model = build(case)[0]
    plain = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    total = sum(plain.values())
    stages: dict[str, set] = {}
    for r in ranks:
        read = set(r["read"]) & set(plain)
        assert read, f"{case.name}: rank {r['rank']}'s chunks read no parameter"
        outside = sorted(set(r["held"]) - read)
        assert not outside, f"{case.name}: rank {r['rank']} holds parameters its chunks never read: {outside}"
        unheld = sorted(read - set(r["held"]))
        assert not unheld, f"{case.name}: rank {r['rank']}'s chunks read parameters it does not hold: {unheld}"
        expected = {}
        for name in read:
            parts = (case.tp if name in r["tp_sharded"] else 1) * (case.ep if name in r["ep_sharded"] else 1)
            assert plain[name] % parts == 0, (name, plain[name], parts)
            expected[name] = plain[name] // parts
        wrong = {n: (r["held"][n], expected[n]) for n in read if r["held"][n] != expected[n]}
        assert not wrong, f"{case.name}: rank {r['rank']} holds (elements, expected): {wrong}"
        assert r["held_numel"] == sum(expected.values())
        if case.pp > 1 or case.tp > 1:
            assert r["held_numel"] < total, (f"{case.name}: rank {r['rank']} holds all {total} "
                                             f"parameter elements with pp={case.pp}, tp={case.tp}")
        p = r["rank"] // (case.dp * case.tp)
        if case.schedule in ("zb-v", "dualpipe-v"):      # V: down the ranks and back up
            assert sorted(r["chunks"]) == [p, 2 * case.pp - 1 - p], r["chunks"]
        else:
            assert r["chunks"] == [p + i * case.pp for i in range(case.virtual_stages)], r["chunks"]
        for name in r["held"]:
            stages.setdefault(name, set()).add(p)
    if case.tp > 1:
        assert any(r["tp_sharded"] for r in ranks), f"{case.name}: tp={case.tp} shards nothing"
    tied = _tied_names(case)
    shared = {n: sorted(ps) for n, ps in stages.items() if len(ps) > 1 and n not in tied}
    assert not shared, f"{case.name}: parameters held by several pipeline stages: {shared}"
    assert set(stages) == {n for n in plain if any(n in r["read"] for r in ranks)}


def _tied_names(case: Case) -> set[str]:
    """Names of the plain model's parameters that several modules share (a tied embedding)."""
    model = build(case)[0]
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    return {n for names in owners.values() if len(names) > 1 for n in names}


