"""Rewrites of a built model for the devices of a host: pipeline stages and tensor (and expert) parallel slices.

layout.py  which rank is which (replica, stage, tp rank), the stage layer ranges
tp.py      apply_tp(): slice q/k/v/gate/up by rows and o/down by columns, one all-reduce after o/down; a Qwen3-MoE
           sparse layer keeps 1/tp of its experts (expert parallel) and all-reduces its fp32 partial sums
pp.py      keep_stage(): a stage keeps its own layers; activations move with send/recv
build.py   build(): the whole model or a rank's part (stage, tp slices) from a checkpoint, a random preset or
           v1's random weights (the one builder: the engines call nothing else)

The engines that run these models (the rank processes included) are in poc.engine.
"""
