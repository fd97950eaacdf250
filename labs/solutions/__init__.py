"""Reference solutions of the labs in ``labs/``: kept beside the notebooks for tests and instructors, outside
the ``workbench`` package a learner imports. A lab notebook run from ``labs/`` imports them as
``solutions.<name>`` when its ``USE_SOLUTION`` parameter is True."""
