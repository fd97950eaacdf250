"""The distributed floor: ranks and what connects them.

``launch`` starts N ranks (spawn or forkserver, a store, a timeout, one device each) and ``rank_pool`` keeps them
warm between notebook cells; ``mesh`` names the axes of a layout and builds its groups; ``comm`` is the one door
every collective goes through (so the tracer sees it); ``emulation`` makes it wait what a cluster's links would take
(emulated nodes, links and stragglers); ``faults`` plants failures on purpose; ``environment``
probes the machine and says what a run can have. Below it: ``theory`` and ``trace``; above it: models, data,
the strategies in ``parallel``, then ``checkpoint`` and ``training``.
"""
