"""workbench: launch real torch.distributed ranks from a notebook, train with every parallelism built
from primitives, and see what happened: timelines, bytes moved, memory per category, beside theory.

The package is built in floors, each importing only those below it: ``theory`` (pure arithmetic) -> ``trace`` ->
``dist`` (ranks, mesh, comm) -> ``models``, ``data`` -> ``parallel`` (the strategies and ``parallelize``) ->
``checkpoint``, ``training`` -> ``viz``, ``widgets`` -> ``run``, ``cli``, ``magics``, ``labs``.
"""
import sys

from workbench.dist import launch as _launch_module
from workbench.dist.launch import RankError, RankResults, launch
from workbench.dist.mesh import Mesh, MeshShape
from workbench.trace import Trace, Tracer

# ``workbench.launch`` is both this package's ``launch()`` and, for code written before issue 19, the old path of
# ``workbench.dist.launch``. It is registered here, as it was loaded here when the module lived at that path, so a
# later ``import workbench.launch`` finds the module and leaves the package's ``launch`` the function (loading an
# alias file then would rebind the package's attribute to the module).
sys.modules.setdefault(f"{__name__}.launch", _launch_module)

__all__ = ["launch", "RankError", "RankResults", "Mesh", "MeshShape", "Trace", "Tracer"]
__version__ = "0.1.0"
