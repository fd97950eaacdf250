"""The training floor: ``config`` (RunConfig, everything that defines a run, validated before ranks start),
``trainer`` (one loop for every strategy: ``Trainer`` and ``train_rank``) and ``health`` (held-out split, loss
spikes, stragglers). ``workbench.run`` runs a config start to end; this floor runs one rank of it."""
