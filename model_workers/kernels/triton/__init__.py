"""The Triton kernel set: the DSA operations as GPU kernels (one module per operation), each checked against the
torch reference (model_workers/kernels/torch/). On a CPU they run in Triton's interpreter when TRITON_INTERPRET=1
is set before this package is imported (the registry refuses the set otherwise)."""
