"""Structured outputs on the rank that samples: the grammar backend behind one small interface, the compile cache,
and each request's matcher (docs/structured_outputs.md)."""
