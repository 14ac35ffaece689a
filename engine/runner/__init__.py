"""The model runner: one scheduler plan → the step's inputs → the model → one sampled token per sequence.

Where it sits: ``Engine.step()`` (``engine/core/engine.py``) calls a :class:`~kvfleet.engine.runner.base.Runner`;
:mod:`kvfleet.engine.runner.model_runner` is the real one (torch), ``engine/sim.py`` the simulator's.
This package's ``__init__`` stays empty so the torch-free core can name the runner's base class.
"""
