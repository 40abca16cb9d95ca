"""The measuring harness of this repository, run from a checkout as `python -m benchmarks KIND` (and by `make
bench`); not installed with the package.

It builds on the installed benchmarks (`dsa-serve bench ...`, cluster/bench/) and adds what only the project needs:
the `transformers` baselines of `serve` and its long workload, the soak driver, the targets and BENCHMARKS.md
with its plots. docs/benchmarks.md says what each benchmark measures and which side of the split it is on.
"""

HARNESS_PROGRAM = "python -m benchmarks"  # what the `command` of a result measured here starts with
