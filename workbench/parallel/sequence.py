"""Old path of workbench.parallel.tensor.sequence (issue 19): sequence parallelism is tensor parallelism's
plan realised with ``SequenceParallelStyles``, so it lives inside the tensor-parallel strategy now.

This module replaces itself with that one in ``sys.modules``, so ``import workbench.parallel.sequence as s``
gives ``s is workbench.parallel.tensor.sequence``: one module, one set of classes and tags. New code imports
``workbench.parallel.tensor.sequence`` (or the names re-exported by ``workbench.parallel.tensor``).
"""
import sys

from workbench.parallel.tensor import sequence as _module

sys.modules[__name__] = _module
