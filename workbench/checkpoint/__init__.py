"""Checkpoints, in one place: ``store`` (atomic, verified, sharded saves and loads: the names below),
``reshard`` (gather a strategy's shards into full tensors and shard them another way), ``resume`` (which
fields a resume must keep, which it may change, and finding the checkpoint to resume from), ``manager`` (the
``CheckpointManager`` a ``Trainer`` calls: when a save is due, what a save holds, and putting it back on resume).

``workbench.checkpoint.save`` and the rest of the store's names stay importable from here, as before issue 19.
"""
from workbench.checkpoint.store import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    AsyncCheckpointer,
    CheckpointError,
    check_state,
    discard_newer,
    ensure_writable,
    export_full_state_dict,
    latest_good,
    list_steps,
    load,
    prune,
    read_manifest,
    rng_state,
    save,
    save_shard,
    set_rng_state,
    shard_name,
    snapshot_to_cpu,
    step_dir,
    verify,
    write_atomic,
    write_manifest,
)

__all__ = ['FORMAT', 'FORMAT_VERSION', 'MANIFEST', 'CheckpointError', 'step_dir', 'shard_name', 'list_steps',
    'ensure_writable', 'check_state', 'write_atomic', 'save_shard', 'write_manifest', 'read_manifest', 'verify',
    'latest_good', 'prune', 'discard_newer', 'save', 'load', 'export_full_state_dict', 'snapshot_to_cpu',
    'AsyncCheckpointer', 'rng_state', 'set_rng_state']
