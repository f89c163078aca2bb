"""The nnet3 compiler front half (request, computation graph, phases, steps) and,
from other modules of this package, the IR and the Compiler itself.

Kept light: only the request types are imported eagerly; import
``engine.compiler.graph`` / ``engine.compiler.steps`` directly for the rest.
"""

from engine.compiler.request import ComputationRequest, IoSpecification, io_spec

__all__ = ["ComputationRequest", "IoSpecification", "io_spec"]
