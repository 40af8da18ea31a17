"""ipukit's benchmark suite: ``python -m benchmarks.run`` (see benchmarks/README.md).

Benchmarks measure; they do not assert. Each result is reported next to its
goal so a regression shows up as a ratio, not as a failing test.
"""
