"""Tensor parallelism in the engine (issue #29): each rank a process holding its shard of the weights and KV heads.

Where it sits: ``engine/runner/model_runner.py`` (rank 0, in the engine core process) uses ``leader.py`` to
start ``worker.py`` processes (ranks 1..tp-1); ``shard.py`` says what each rank holds,
``group.py`` sets up the process group and its collectives, ``step_inputs.py`` carries a step's
inputs from rank 0 to the workers. The model sees only ``engine/model/tp.py``'s Protocols.
"""
