"""Reference compute orders written from the schedules' definitions, not from autopart's C++.

Only the order of forwards (F) and backwards (B) per rank, as tokens like "4F2". The C++
generators index "virtual microbatches" arithmetically; this builds the same orders from lists.

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
"""

from __future__ import annotations


def compute_order(name: str, pp: int, microbatches: int, virtual_stages: int, rank: int) -> list[str]:
    if name == "gpipe":
        return gpipe(microbatches, rank)
    if name == "1f1b":
        return one_f_one_b(pp, microbatches, rank)
    if name == "interleaved-1f1b":
        return interleaved(pp, microbatches, virtual_stages, rank)
    raise ValueError(name)


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
