"""Transformer building blocks: attention, MLP, norms, linear layers (with the zero-bubble split
backward) and their tensor-parallel forms, which attention and the MLP build when given a TPContext."""
