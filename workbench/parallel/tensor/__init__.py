"""Tensor parallelism (Megatron-LM), with sequence parallelism as its second set of styles.

Every rank of the tp group holds a slice of each weight matrix (Shoeybi et al. 2019, "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", §3): attention and the MLP are split into
column- and row-parallel layers joined by Megatron's f and g, the GPT's embedding and tied head along the
vocabulary, and the loss is computed from logit slices. Sequence parallelism (Korthikanti et al. 2022, §4.2.2)
is the same plan with the replicated regions sharded along the sequence: g/ḡ (all-gather, reduce-scatter)
in place of f/g. One strategy, one plan, two sets of styles (``TensorParallelStyles``,
``SequenceParallelStyles``).

Where things are (each module's docstring has the details):

- ``layers.py``: the tp group (``TPGroup``, ``tp_group_of``), f and g (``copy_to_tp_region``,
  ``reduce_from_tp_region``), ``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``;
- ``loss.py``: ``vocab_parallel_cross_entropy``, the loss from this rank's logits [b, s, V/tp];
- ``plan.py``: ``BLOCK_PLAN``/``gpt_plan`` (module name -> style), ``TensorParallelStyles``, ``apply_plan``,
  ``apply_tensor_parallel`` and ``check_tensor_parallel_sizes`` for the tiny GPT;
- ``shards.py``: ``full_parameters``/``full_gradients``/``gather_full`` (shards back to full tensors),
  ``norm_weights`` and ``clip_grad_norm_``;
- ``sequence.py``: sequence parallelism, ``SequenceParallelStyles`` and ``apply_sequence_parallel``; its old
  path ``workbench.parallel.sequence`` is an alias of this module (the same module object).

Every name below is importable from ``workbench.parallel.tensor`` itself, as it was when this was one file.
"""

from __future__ import annotations

from workbench.parallel.tensor import sequence
from workbench.parallel.tensor.layers import (
    TP_TAG,
    VOCAB_TAG,
    ColumnParallelLinear,
    CopyToTensorParallelRegion,
    ReduceFromTensorParallelRegion,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    copy_to_tp_region,
    reduce_from_tp_region,
    tp_group_of,
)
from workbench.parallel.tensor.loss import LOSS_TAG, VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from workbench.parallel.tensor.plan import (
    BLOCK_PLAN,
    STYLES,
    TensorParallelStyles,
    apply_plan,
    apply_tensor_parallel,
    check_tensor_parallel_sizes,
    gpt_plan,
)
from workbench.parallel.tensor.sequence import (
    SequenceParallelStyles,
    all_reduce_sequence_parallel_grads,
    apply_sequence_parallel,
    check_sequence_parallel_sizes,
    sequence_parallel_parameters,
)
from workbench.parallel.tensor.shards import (
    GATHER_TAG,
    clip_grad_norm_,
    full_gradients,
    full_parameters,
    gather_full,
    norm_weights,
)

__all__ = [
    "BLOCK_PLAN", "GATHER_TAG", "LOSS_TAG", "STYLES", "TP_TAG", "VOCAB_TAG", "ColumnParallelLinear",
    "CopyToTensorParallelRegion", "ReduceFromTensorParallelRegion", "RowParallelLinear", "SequenceParallelStyles",
    "TPGroup", "TensorParallelStyles", "VocabParallelCrossEntropy", "VocabParallelEmbedding",
    "all_reduce_sequence_parallel_grads", "apply_plan", "apply_sequence_parallel", "apply_tensor_parallel",
    "check_sequence_parallel_sizes", "check_tensor_parallel_sizes", "clip_grad_norm_", "copy_to_tp_region",
    "full_gradients", "full_parameters", "gather_full", "gpt_plan", "norm_weights", "reduce_from_tp_region",
    "sequence", "sequence_parallel_parameters", "tp_group_of", "vocab_parallel_cross_entropy",
]
