"""Transformer building blocks (single-device here; tensor-parallel variants build on these)."""
