"""The reference kernel set: today's torch code, on CPU and CUDA alike (kernel_set.py assembles it)."""
