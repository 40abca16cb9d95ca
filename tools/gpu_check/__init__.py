"""Helpers of tools/gpu_check.py, the prepared GPU check (issue 45): the run's deadline and JSON record (runtime),
timing and comparisons (measure), the shapes (plan), one module per section, and the closing table (report)."""
