"""Rank functions and the helpers they share, which the processes the multi-process tests spawn
(autopart.runtime.launch.spawn) import by module path: one module per feature.

common.py holds what every feature shares (tolerances, models, `Case`, `build`, `_compare`, the
views of what a rank holds); equivalence.py the equivalence harness (`equivalence`, `run_cases`,
`run_group`, `assert_all_ranks_equal_plain`) and a few other rank functions on those models; the
other modules hold one feature's rank functions each (checkpoint.py: tests/test_checkpoint.py,
moe.py: expert parallelism, ...).
"""
