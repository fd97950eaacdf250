"""Old path of ``workbench.training.trainer``, kept for notebooks and scripts written before issue 19.

The same module object (``sys.modules`` points here to it), so ``workbench.train.X``, a patch of it and
an ``isinstance`` check all agree with the new path. The package itself imports only the new path."""
import sys

from workbench.training import trainer as module

sys.modules[__name__] = module
