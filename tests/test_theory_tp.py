"""Hand-checked numbers for tensor parallelism's communication (workbench.theory.comm; pure Python).

tests/test_tensor_parallel.py checks the same functions against the comm log of a real tp run."""

from __future__ import annotations

import pytest

from workbench.theory.comm import tp_block_collectives, tp_block_volume, tp_vocab_collectives

# b = 8 sequences of s = 16 tokens, h = 64, fp32: one activation X [b, s, h] is 8·16·64·4 = 32,768 bytes.
B, S, H = 8, 16, 64
X_BYTES = 32_768


def test_a_block_is_two_all_reduces_forward_and_two_backward():
    got = tp_block_collectives(B, S, H)
    assert got == {"forward": [("all_reduce", X_BYTES)] * 2, "backward": [("all_reduce", X_BYTES)] * 2}
    assert tp_block_collectives(B, S, H, bytes_per_elem=2)["forward"][0] == ("all_reduce", X_BYTES / 2)  # bf16


@pytest.mark.parametrize("tp, wire", [(1, 0.0), (2, 4 * X_BYTES), (4, 4 * 1.5 * X_BYTES), (8, 4 * 1.75 * X_BYTES)])
def test_block_volume_tensor_logical_and_ring_wire(tp, wire):
    got = tp_block_volume(B, S, H, tp)
    # 4 all-reduces of b·s·h·4 bytes whatever tp: TP splits weights and work, not the activations it reduces.
    assert got["tensor"] == 4 * X_BYTES == 131_072
    assert got["logical"] == 8 * X_BYTES  # an all-reduce counted as 2S, as dp_step_volume does
    assert got["ring_wire"] == pytest.approx(wire)  # 4 · 2(tp−1)/tp · S


def test_vocab_parallel_embedding_head_and_loss():
    got = tp_vocab_collectives(B, S, H)
    # embedding's g; then max, target logit, sum of exponentials: 128 tokens x 4 bytes each, never b·s·V
    assert got["forward"] == [("all_reduce", X_BYTES)] + [("all_reduce", 512)] * 3
    assert got["backward"] == [("all_reduce", X_BYTES)]  # the head's f


@pytest.mark.parametrize("call", [
    lambda: tp_block_collectives(0, S, H),
    lambda: tp_block_volume(B, S, H, tp=0),
    lambda: tp_vocab_collectives(B, -1, H),
])
def test_bad_sizes_raise(call):
    with pytest.raises(ValueError, match="must be a positive int"):
        call()
