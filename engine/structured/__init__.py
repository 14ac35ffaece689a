"""Structured outputs in the core process: grammars compiled off the step loop, token masks on the sampler's path.

Where it sits: ``Engine.add_request`` hands a constrained request's :class:`StructuredOutputSpec`
to :class:`StructuredOutputs`, which compiles it on a thread pool (cached by spec,
:mod:`.compiler`) while the request waits unscheduled; once compiled, each of its sequences gets
a grammar matcher. Every step the runner calls :meth:`StructuredOutputs.mask` on the logits
(whichever forward produced them) before the sampler, and the engine advances the matchers
with the sampled tokens (:meth:`StructuredOutputs.accept`). xgrammar (and so torch) is imported
here only: the API process never loads this package.
"""

from kvfleet.engine.structured.manager import StructuredOutputs

__all__ = ["StructuredOutputs"]
