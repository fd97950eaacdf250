"""workbench: launch real torch.distributed ranks from a notebook, train with every parallelism built
from primitives, and see what happened: timelines, bytes moved, memory per category, beside theory."""

from workbench.launch import RankError, RankResults, launch
from workbench.mesh import Mesh, MeshShape
from workbench.trace import Trace, Tracer

__all__ = ["launch", "RankError", "RankResults", "Mesh", "MeshShape", "Trace", "Tracer"]
__version__ = "0.1.0"
