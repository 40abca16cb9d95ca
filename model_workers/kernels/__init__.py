"""The DSA kernels behind one interface per operation (interface.py), in kernel sets picked by name (registry.py).

`torch/` is the reference set. A kernel set imports nothing of the project outside this folder: no engine, cluster
or model-family code (tests/test_layering.py)."""
