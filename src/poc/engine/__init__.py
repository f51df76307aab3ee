"""Every engine: what runs jobs on the devices (tests/test_layers.py checks that no other room defines one).

base.py      EngineBase, the interface the server uses (states, the device claim, model info, memory checks, run)
engine.py    Engine: one device, in this process
dist.py      DistEngine: replicas x pp x tp rank processes over torch.distributed (load, deal a job: JobRun)
rankgroup.py RankGroup: one generation of rank processes (spawn, read, fail, kill, watchdog), RankConfig
ranks.py     the rank process (python -m poc.engine.ranks): SPMD loop, jobs handed on by each replica's leader
factory.py   make_engine(): the one choice of engine (server, CLI, bench), --layout auto by auto.py
compute.py   one batch: inputs -> forward -> post-process, on one device or a pipeline stage
jobs.py      jobs and results (the data the server and the engines share) and the one dealing rule (Dealer)
memory.py    memory estimates; v1inputs.py the v1 inputs drawn by worker processes
"""
