"""Optimizers and the gradient engine.

engine.py      GradEngine: bucketed gradient reduction and the optimizer step for every ZeRO stage
bucket.py      one flat bucket and the state machine of its reduction
units.py       ZeRO-3's units (a layer's parts merged up to a size) and the regions that read them
gather.py      ZeRO-3's per-unit parameter gathering as forward, backward and recompute use them
state.py       the engine's weights and optimizer state in a checkpoint
builder.py     optimizers by name, parameter groups, build_engine
loss_scale.py  fp16 dynamic loss scaling;  lr.py the LR schedule;  memory.py model-state bytes
"""
