"""Reference compute orders written from the schedules' definitions, not from autopart's C++.

Only the order of forwards (F) and backwards (B, or its halves I and W) per rank, as tokens like
"4F2". The C++ generators index "virtual microbatches" arithmetically; this builds the same orders
from lists. Also where chunks live, the memory an order holds, and a unit-time timing of an order
(every compute as early as its inputs allow) to check the simulator against.

GPipe (Huang et al. 2019): every forward, then every backward.

1F1B (PipeDream-Flush; Narayanan et al. 2021 section 2.2; Megatron-LM's
forward_backward_pipelining_without_interleaving): rank r runs pp - r - 1 warmup forwards, then
alternates one forward and one backward, then runs the backwards left.

Interleaved 1F1B (Narayanan et al. 2021 section 2.2 and Figure 4; Megatron-LM's
forward_backward_pipelining_with_interleaving): rank r holds model chunks r, r + pp, ...,
r + (v-1)*pp. Microbatches go in groups of pp: a group runs forward through the rank's first
chunk, then the same group through its second chunk, and so on, before the next group starts;
backwards go through the chunks in reverse. Rank r warms up with (v-1)*pp + 2*(pp-r-1) forwards
(Megatron's get_pp_rank_microbatches), or all of them if there are fewer, then alternates.

ZB-H1 (Qi et al. 2024 section 3; torch's ScheduleInterleavedZeroBubble, which is also its
interleaved form): the interleaved sequence above with (v-1)*pp + (pp-r-1) warmup forwards, an I
where 1F1B has a B, and rank r holding back r weight gradients: after its k-th I (counting from
0) it runs the W of its (k-r)-th, and the held-back Ws at the end. v=1 is plain microbatch order.

ZB-V (Qi et al. section 6; torch's ScheduleZBVZeroBubble): rank r holds chunk r (going down the V)
and chunk 2pp-1-r (coming back). Written for n = max(m, 2pp-1) microbatches, actions of the
microbatches >= m dropped: 2(pp-r)-1 forwards of the down chunk; r times (up F, down F); pp-r
times (up F, I, W); then while forwards are left: (down F if any left; down I, W; up F, I, W);
then r times (down I, up I); pp-r times (down I, the oldest down W not yet run); the up Ws left;
the down Ws left.

DualPipeV (DeepSeek-V3's DualPipe, cut in half; torch's ScheduleDualPipeV), same V placement,
m >= 2pp: (1) 2(pp-r-1) down F; (2) r+1 times (down F, up F); (3) pp-r-1 times (up I, queued W,
up F); (4) m-2pp+r+1 times (down F & up B, up F & down B), "&" an overlapped pair whose forward
output leaves when the pair is done, except that the last rank's first down F / up B are not
overlapped; (5) pp-r-1 times (up B, up F & down B); (6) r+1 times (up, down backward) where from
the middle one on the backwards are split (I, W queued); odd ranks split the up one of the middle
pair too; (7) pp-r-1 times (queued W, down backward); (8) the queued Ws.
"""

from __future__ import annotations


def allowed_cases(name: str, max_pp: int = 8):
    """Every (pp, v, m) with pp <= max_pp, v <= 4, m <= 4*pp that the schedule accepts."""
    for pp in range(1, max_pp + 1):
        for v in range(1, 5):
            for m in range(1, 4 * pp + 1):
                if name == "interleaved-1f1b" or (name == "zb-h1" and v > 1):
                    if pp >= 2 and v >= 2 and m % pp == 0:
                        yield pp, v, m
                elif name in ("zb-v", "dualpipe-v"):
                    if v == 2 and (name == "zb-v" or m >= 2 * pp):
                        yield pp, v, m
                elif v == 1:
                    yield pp, v, m


def compute_order(name: str, pp: int, microbatches: int, virtual_stages: int, rank: int) -> list[str]:
    if name == "gpipe":
        return gpipe(microbatches, rank)
    if name == "1f1b":
        return one_f_one_b(pp, microbatches, rank)
    if name == "interleaved-1f1b":
        return interleaved(pp, microbatches, virtual_stages, rank)
    if name == "zb-h1":
        return zb_h1(pp, microbatches, virtual_stages, rank)
    if name == "zb-v":
        return zb_v(pp, microbatches, rank)
    if name == "dualpipe-v":
        return [token for token, _ in dualpipe_v(pp, microbatches, rank)]
    raise ValueError(name)


def chunk_rank(name: str, pp: int, chunk: int) -> int:
    """The V of zb-v and dualpipe-v: down through ranks 0..pp-1, back up through pp-1..0."""
    if name in ("zb-v", "dualpipe-v"):
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def gpipe(microbatches: int, rank: int) -> list[str]:
    return [f"{rank}F{i}" for i in range(microbatches)] + [f"{rank}B{i}" for i in range(microbatches)]


def one_f_one_b(pp: int, microbatches: int, rank: int) -> list[str]:
    forwards = [f"{rank}F{i}" for i in range(microbatches)]
    backwards = [f"{rank}B{i}" for i in range(microbatches)]
    return _warmup_steady_cooldown(forwards, backwards, warmup=pp - rank - 1)


def interleaved(pp: int, microbatches: int, virtual_stages: int, rank: int) -> list[str]:
    chunks = [rank + j * pp for j in range(virtual_stages)]
    groups = [range(start, start + pp) for start in range(0, microbatches, pp)]
    forwards = [f"{c}F{i}" for group in groups for c in chunks for i in group]
    backwards = [f"{c}B{i}" for group in groups for c in reversed(chunks) for i in group]
    return _warmup_steady_cooldown(forwards, backwards, warmup=(virtual_stages - 1) * pp + 2 * (pp - rank - 1))


def _warmup_steady_cooldown(forwards: list[str], backwards: list[str], warmup: int) -> list[str]:
    warmup = min(warmup, len(forwards))
    steady = [token for pair in zip(forwards[warmup:], backwards) for token in pair]
    return forwards[:warmup] + steady + backwards[len(forwards) - warmup :]


def zb_h1(pp: int, microbatches: int, virtual_stages: int, rank: int) -> list[str]:
    chunks = [rank + j * pp for j in range(virtual_stages)]
    groups = [range(start, min(start + pp, microbatches)) for start in range(0, microbatches, pp)]
    forwards = [f"{c}F{i}" for group in groups for c in chunks for i in group]
    inputs = [f"{c}I{i}" for group in groups for c in reversed(chunks) for i in group]
    warmup = min((virtual_stages - 1) * pp + pp - rank - 1, len(forwards))
    order = forwards[:warmup]
    held_back: list[str] = []
    for k, input_grad in enumerate(inputs):
        if warmup + k < len(forwards):
            order.append(forwards[warmup + k])
        order.append(input_grad)
        held_back.append(input_grad.replace("I", "W"))
        if k >= rank:
            order.append(held_back.pop(0))
    return order + held_back


def zb_v(pp: int, microbatches: int, rank: int) -> list[str]:
    n = max(microbatches, 2 * pp - 1)
    down, up = rank, 2 * pp - 1 - rank
    done = {(c, k): 0 for c in (down, up) for k in "FIW"}
    order: list[tuple[int, str, int]] = []

    def run(chunk: int, *kinds: str) -> None:
        for kind in kinds:
            order.append((chunk, kind, done[chunk, kind]))
            done[chunk, kind] += 1

    run(down, *"F" * (2 * (pp - rank) - 1))
    for _ in range(rank):
        run(up, "F"), run(down, "F")
    for _ in range(pp - rank):
        run(up, "F", "I", "W")
    while done[up, "F"] < done[down, "F"] or done[down, "F"] < n:
        if done[down, "F"] < n:
            run(down, "F")
        run(down, "I", "W")
        run(up, "F", "I", "W")
    for _ in range(rank):
        run(down, "I"), run(up, "I")
    for _ in range(pp - rank):
        run(down, "I", "W")
    while done[up, "W"] < done[up, "I"]:
        run(up, "W")
    while done[down, "W"] < done[down, "I"]:
        run(down, "W")
    return [f"{c}{k}{i}" for c, k, i in order if i < microbatches]


def dualpipe_v(pp: int, microbatches: int, rank: int) -> list[tuple[str, bool]]:
    """(token, overlapped with the next token) pairs."""
    down, up = rank, 2 * pp - 1 - rank
    forwards = {down: 0, up: 0}
    backwards = {down: 0, up: 0}
    weights: list[str] = []
    order: list[tuple[str, bool]] = []

    def forward(chunk: int, overlapped: bool = False) -> None:
        order.append((f"{chunk}F{forwards[chunk]}", overlapped))
        forwards[chunk] += 1

    def backward(chunk: int, split: bool) -> None:
        i = backwards[chunk]
        backwards[chunk] += 1
        order.append((f"{chunk}{'I' if split else 'B'}{i}", False))
        if split:
            weights.append(f"{chunk}W{i}")

    def weight() -> None:
        if weights:
            order.append((weights.pop(0), False))

    for _ in range(2 * (pp - rank - 1)):
        forward(down)
    for _ in range(rank + 1):
        forward(down), forward(up)
    for _ in range(pp - rank - 1):
        backward(up, True), weight(), forward(up)
    for i in range(microbatches - 2 * pp + rank + 1):
        forward(down, overlapped=not (i == 0 and rank == pp - 1)), backward(up, False)
        forward(up, overlapped=True), backward(down, False)
    for _ in range(pp - rank - 1):
        backward(up, False), forward(up, overlapped=True), backward(down, False)
    middle = (rank + 1) // 2
    for i in range(rank + 1):
        backward(up, i > middle or (i == middle and rank % 2 == 1))
        backward(down, i >= middle)
    for _ in range(pp - rank - 1):
        weight(), backward(down, True)
    while weights:
        weight()
    return order


def peak_in_flight(tokens: list[str]) -> tuple[int, int]:
    """(most forwards awaiting their B or W, most Is awaiting their W) in one rank's order."""
    live = awaiting = peak = peak_awaiting = 0
    for token in tokens:
        kind = _kind(token)
        live += kind == "F"
        live -= kind in "BW"
        awaiting += kind == "I"
        awaiting -= kind == "W"
        peak, peak_awaiting = max(peak, live), max(peak_awaiting, awaiting)
    return peak, peak_awaiting


UNIT_COSTS = {"F": 1, "I": 1, "W": 1, "B": 2}


def unit_time_makespan(name: str, pp: int, microbatches: int, virtual_stages: int) -> tuple[int, int]:
    """(makespan, ideal) with F = I = W = 1 and B = 2 per chunk, every compute as early as its
    inputs and its rank allow, communication free; a forward overlapped with the next backward
    (DualPipeV's F&B) hands its output on only when the pair is done."""
    chunks = pp * virtual_stages
    if name == "dualpipe-v":
        orders = [dualpipe_v(pp, microbatches, r) for r in range(pp)]
    else:
        orders = [[(t, False) for t in compute_order(name, pp, microbatches, virtual_stages, r)] for r in range(pp)]
    split = {_parse(t)[::2] for order in orders for t, _ in order if _kind(t) == "I"}
    ready: dict[tuple[int, str, int], int] = {}
    clock, busy, position = [0] * pp, [0] * pp, [0] * pp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while position[r] < len(orders[r]):
                token, overlapped = orders[r][position[r]]
                start = _inputs_ready(_parse(token), chunks, split, ready)
                if start is None:
                    break
                clock[r] = max(clock[r], start) + UNIT_COSTS[_kind(token)]
                busy[r] += UNIT_COSTS[_kind(token)]
                previous = orders[r][position[r] - 1] if position[r] else None
                if not overlapped:
                    ready[_parse(token)] = clock[r]
                if previous and previous[1]:
                    ready[_parse(previous[0])] = clock[r]
                position[r] += 1
                progress = True
    assert all(position[r] == len(orders[r]) for r in range(pp)), "order cannot run"
    return max(clock), max(busy)


_COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_PEER = {"SEND_F": (1, "RECV_F"), "RECV_F": (-1, "SEND_F"), "SEND_B": (-1, "RECV_B"),
         "RECV_B": (1, "SEND_B")}


def posted_makespan(lists: list[list[str]], cost, latency: float) -> float:
    """The step time of action lists (tokens like "1RECV_F3") run the way the runtime runs them
    on Gloo: a post never waits; a compute first waits for the receive it reads (F its RECV_F, B
    or I its RECV_B) and every receive its rank posted before that one; the list's end waits for
    every receive and send left. A message arrives `latency` after both sides have posted it.
    cost(chunk, kind) -> time of one compute. Written from the runtime's description
    (runtime/executor.py), not from the C++ simulator."""
    acts = [[_parse_any(t) for t in lst] for lst in lists]
    posted: dict = {}                        # comm action -> when its rank posted it
    clock, at = [0.0] * len(acts), [0] * len(acts)
    receives: list = [[] for _ in acts]      # per rank: posted, not yet waited, in order
    sends: list = [[] for _ in acts]

    def arrival(action):
        c, kind, i = action
        step, peer_kind = _PEER[kind]
        peer = (c + step, peer_kind, i)
        return None if peer not in posted else max(posted[action], posted[peer]) + latency

    def wait(r, queue, n) -> bool:           # the first n of the queue, in order
        times = [arrival(a) for a in queue[:n]]
        if None in times:
            return False
        clock[r] = max([clock[r], *times])
        del queue[:n]
        return True

    progress = True
    while progress:
        progress = False
        for r, lst in enumerate(acts):
            while at[r] < len(lst):
                c, kind, i = lst[at[r]]
                if kind in _COMM:
                    posted[lst[at[r]]] = clock[r]
                    (sends if kind.startswith("SEND") else receives)[r].append(lst[at[r]])
                else:
                    need = (c, "RECV_F" if kind == "F" else "RECV_B", i)
                    if kind != "W" and need in receives[r] and \
                            not wait(r, receives[r], receives[r].index(need) + 1):
                        break
                    clock[r] += cost(c, kind)
                at[r] += 1
                progress = True
            if at[r] == len(lst) and (receives[r] or sends[r]):
                if wait(r, receives[r], len(receives[r])) and wait(r, sends[r], len(sends[r])):
                    progress = True
    assert all(at[r] == len(acts[r]) and not receives[r] and not sends[r]
               for r in range(len(acts))), "the lists deadlock"
    return max(clock)


def _parse_any(token: str) -> tuple[int, str, int]:
    """"1RECV_F3" -> (1, "RECV_F", 3); "4F2" -> (4, "F", 2)."""
    head = len(token) - len(token.lstrip("0123456789"))
    tail = len(token.rstrip("0123456789"))
    return int(token[:head]), token[head:tail], int(token[tail:])


def _inputs_ready(action, chunks, split, ready) -> int | None:
    c, kind, i = action
    needs = []
    if kind == "F" and c > 0:
        needs.append((c - 1, "F", i))
    if kind in "IB":
        needs.append((c, "F", i))
        if c + 1 < chunks:
            needs.append((c + 1, "I" if (c + 1, i) in split else "B", i))
    if kind == "W":
        needs.append((c, "I", i))
    if any(n not in ready for n in needs):
        return None
    return max((ready[n] for n in needs), default=0)


def _parse(token: str) -> tuple[int, str, int]:
    kind = _kind(token)
    chunk, microbatch = token.split(kind)
    return int(chunk), kind, int(microbatch)


def _kind(token: str) -> str:
    return next(ch for ch in token if ch.isalpha())
