"""All the devices of a host: replicas x pipeline stages x tensor-parallel ranks over torch.distributed.

layout.py  which rank is which (replica, stage, tp rank), the stage layer ranges
tp.py      apply_tp(): slice q/k/v/gate/up by rows and o/down by columns, one all-reduce after o/down; a Qwen3-MoE
           sparse layer keeps 1/tp of its experts (expert parallel) and all-reduces its fp32 partial sums
pp.py      keep_stage(): a stage keeps its own layers; activations move with send/recv
shard.py   this rank's model: checkpoint slices read straight from the safetensors, or v1's random weights
ranks.py   the rank process (python -m poc.parallel.ranks): SPMD loop, jobs broadcast by each replica's leader
engine.py  DistEngine (the Engine interface over the rank processes) and make_engine()
"""
