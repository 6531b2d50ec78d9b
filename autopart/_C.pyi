"""autopart's C++ core (csrc/). Private: use autopart.schedule.

Schedules cross the boundary "packed": one list per rank of (chunk, kind code, microbatch)
tuples, kind codes indexing kind_names() (the order of autopart.schedule.Kind). A schedule's
name decides where its chunks live (chunk_rank): pass it to check / in_flight / simulate.
Errors in a schedule's arguments raise autopart.schedule.ScheduleError (a ValueError); bad
costs or partition inputs raise ValueError.
"""

Packed = list[list[tuple[int, int, int]]]

def version() -> str: ...
def kind_names() -> list[str]: ...
def schedule_names() -> list[str]: ...
def chunk_rank(name: str, pp: int, virtual_stages: int, chunk: int) -> int: ...
def placement_text(name: str, pp: int) -> str: ...
def make_schedule(name: str, pp: int, microbatches: int, virtual_stages: int) -> Packed: ...
def check(
    pp: int, microbatches: int, virtual_stages: int, ranks: Packed, name: str = "", sends_wait: bool = True
) -> tuple[str, list[tuple[int, int]]] | None:
    """None if valid, else (message, [(rank, step) of the offending actions]); sends_wait=False:
    deadlock-free under Gloo's semantics (posts never wait) rather than NCCL's."""

def in_flight(
    pp: int, microbatches: int, virtual_stages: int, ranks: Packed, name: str = ""
) -> tuple[list[int], list[int], list[int]]:
    """(peak_in_flight, peak_awaiting_weight_grad) per rank, peak in flight per chunk."""

class SimResult:
    @property
    def makespan(self) -> float: ...
    @property
    def ideal(self) -> float: ...
    @property
    def bubble(self) -> float: ...
    @property
    def busy(self) -> list[float]: ...
    @property
    def idle(self) -> list[float]: ...
    @property
    def peak_in_flight(self) -> list[int]: ...
    @property
    def peak_awaiting_weight_grad(self) -> list[int]: ...
    @property
    def times(self) -> list[list[tuple[float, float]]]: ...

def simulate(
    pp: int,
    microbatches: int,
    virtual_stages: int,
    ranks: Packed,
    forward: list[float],
    backward: list[float],
    latency: float,
    bandwidth: float,
    message_bytes: float,
    input_grad: list[float] = ...,
    weight_grad: list[float] = ...,
    name: str = "",
    sends_wait: bool = True,
) -> SimResult: ...
def balanced_partition(costs: list[float], k: int) -> list[int]: ...
