"""Context parallelism (ring attention, Liu et al. 2023): ring attention's output, log-sum-exp and dQ/dK/dV
against full attention on one process (cp = 2 and 4, causal or not, zigzag and contiguous layouts); its comm log
against ``theory.context.ring_kv_bytes`` to the byte; the transfer issued before each block is computed; its
counted work against ``attention_work``/``computed_pairs`` (zigzag balanced, contiguous not) and its saved bytes
against ``activation_memory_per_rank``; a tiny GPT with ``apply_context_parallel`` whose cp-averaged gradients
equal one process's on the whole sequence; the one-rank case bit for bit; layouts and bad inputs.

All the multi-rank work runs in two launches (2 and 4 ranks, module fixtures) whose ranks return plain tensors.

Tolerances, all fp32 (tests/equivalence.py; any CPU):
* ring attention vs full attention (explicit fp32 softmax on the unsharded q/k/v): the ring adds the same
  exp(s − m)·v terms in another order (block by block, rescaled by the online-softmax factor e^(m−m'), which is
  one rounding per merge) and divides once at the end, so out, lse and dQ/dK/dV agree within ROUNDOFF_K eps of the
  quantity's own largest element (each is computed together as a family). Measured over cp = 2, 4, both layouts,
  causal or not (x86 CPU, default ISA): at most 4.2 eps of scale (out 4.2, lse 0.76, dQ 3.8, dK 2.7, dV 3.9).
* the GPT's loss and gradients (cp ranks, each its tokens, gradients averaged) vs one process: another order of
  the same sums through 2 layers: ROUNDOFF_K eps of the loss, and of the largest gradient for the gradients
  (``assert_all_close_to_scale``). Measured: loss within 0.72 eps, gradients within 2.2 eps of the largest.
* bytes and counts (comm log, saved activations, pairs, blocks) are integers: theory must match them exactly.
* the one-rank case runs ``F.scaled_dot_product_attention`` itself: bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from equivalence import ROUNDOFF_K, assert_all_close_to_scale, assert_close_to_scale, eps, gpt_batch, scale_of

from workbench import launch, trace
from workbench.dist import comm
from workbench.models import GPTConfig, ToyMLP, build_gpt
from workbench.parallel import context as cp_mod
from workbench.parallel.context import (
    BLOCK_SPAN,
    CP_GRAD_TAG,
    CP_KV_TAG,
    LAYOUTS,
    apply_context_parallel,
    attention_work,
    check_cp,
    chunk_positions,
    computed_pairs,
    ring_attention,
    ring_attention_with_lse,
    shard_inputs,
    shard_sequence,
    skipped_blocks,
    take_ring_stats,
    unshard_sequence,
)
from workbench.theory.context import activation_memory_per_rank, kv_transfer_vs_compute, ring_kv_bytes

pytestmark = [pytest.mark.numerics, pytest.mark.timeout(120)]

B, H, S, HD = 2, 2, 32, 8
CASES = [(True, "zigzag"), (True, "contiguous"), (False, "zigzag"), (False, "contiguous")]
TINY = GPTConfig.preset("tiny")  # 2 layers, 2 heads, d_model 64, seq_len 64
GPT_BATCH = 2
TIMEOUT = 60


def _seeded(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _global_inputs() -> dict[str, torch.Tensor]:
    return {"q": _seeded(B, H, S, HD, seed=1), "k": _seeded(B, H, S, HD, seed=2), "v": _seeded(B, H, S, HD, seed=3),
            "probe_out": _seeded(B, H, S, HD, seed=4), "probe_lse": _seeded(B, H, S, seed=5)}


def _log(start: int, stop: int | None = None) -> list[tuple]:
    return [(c.tag, c.op, c.nbytes, c.peer, c.t0, c.t1) for c in trace.current().trace.comms[start:stop]]


# -- rank side -------------------------------------------------------------------------------------------------

def _attention_case(rank: int, cp: int, causal: bool, layout: str) -> dict:
    g = _global_inputs()
    q, k, v = (shard_sequence(g[n], cp, rank, layout, dim=2).requires_grad_() for n in "qkv")
    tracer = trace.current()
    comms, spans = tracer.trace.comms, tracer.trace.spans
    c0, s0 = len(comms), len(spans)
    take_ring_stats()
    with tracer.activations():
        out, lse = ring_attention_with_lse(q, k, v, None, causal=causal, layout=layout)
    saved = tracer.memory.current["activations"]
    tracer.release_activations()
    stats, c1 = take_ring_stats(), len(comms)
    loss = (out * shard_sequence(g["probe_out"], cp, rank, layout, dim=2)).sum() + \
        (lse * shard_sequence(g["probe_lse"], cp, rank, layout, dim=2)).sum()
    loss.backward()
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "forward": _log(c0, c1), "backward": _log(c1), "stats": stats, "saved": saved,
            "spans": [(sp.category, sp.t0, sp.t1) for sp in spans[s0:] if sp.name == BLOCK_SPAN]}


def _gpt_case(layout: str) -> dict:
    model = apply_context_parallel(build_gpt(TINY, seed=0), None, layout)
    x, y = gpt_batch(0, GPT_BATCH, seq_len=TINY.seq_len)
    idx, targets, positions = shard_inputs(x, y, None, layout)
    comms = trace.current().trace.comms
    c0 = len(comms)
    loss = model(idx, targets, positions=positions)
    c1 = len(comms)
    loss.backward()
    c2 = len(comms)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for grad in grads.values():
        comm.all_reduce(grad, "avg", tag="grad")
    loss = loss.detach().clone()
    comm.all_reduce(loss, "avg", tag="loss")
    return {"loss": loss, "grads": grads, "forward": _log(c0, c1), "backward": _log(c1, c2)}


def _explicit_attention(rank: int, cp: int) -> dict:
    """The same cases through the explicit fp32 block arithmetic (what a GPU or a 16-bit input takes) instead of
    the fused CPU kernel."""
    fused = cp_mod._FLASH_CPU
    cp_mod._FLASH_CPU = None
    try:
        return {case: _attention_case(rank, cp, *case) for case in CASES}
    finally:
        cp_mod._FLASH_CPU = fused


def _rank() -> dict:
    rank, cp = dist.get_rank(), dist.get_world_size()
    return {"attention": {case: _attention_case(rank, cp, *case) for case in CASES},
            "explicit": _explicit_attention(rank, cp),
            "gpt": {layout: _gpt_case(layout) for layout in LAYOUTS}}


@pytest.fixture(scope="module")
def ranks2() -> list[dict]:
    return launch(_rank, 2, device="cpu", timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ranks4() -> list[dict]:
    return launch(_rank, 4, device="cpu", timeout=TIMEOUT)


@pytest.fixture(params=[2, 4], ids=["cp2", "cp4"])
def ranks(request) -> list[dict]:
    return request.getfixturevalue(f"ranks{request.param}")


# -- reference -------------------------------------------------------------------------------------------------

def _reference(causal: bool) -> dict[str, torch.Tensor]:
    """Full attention on one process, unsharded, fp32: explicit softmax and logsumexp, autograd's gradients."""
    g = _global_inputs()
    q, k, v = (g[n].clone().requires_grad_() for n in "qkv")
    s = q @ k.transpose(-1, -2) / math.sqrt(HD)
    if causal:
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), -math.inf)
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v
    ((out * g["probe_out"]).sum() + (lse * g["probe_lse"]).sum()).backward()
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _reference_gpt() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build_gpt(TINY, seed=0)
    loss = model(*gpt_batch(0, GPT_BATCH, seq_len=TINY.seq_len))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _worst_units(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| in eps of max |want| (what the docstring's measured figures are)."""
    return float((got - want).abs().max()) / (eps() * scale_of([want]))


# -- ring attention vs full attention ---------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", ["attention", "explicit"], ids=["fused-cpu-blocks", "explicit-blocks"])
@pytest.mark.parametrize("causal,layout", CASES)
def test_ring_attention_matches_full_attention(ranks, causal, layout, kernel):
    want = _reference(causal)
    got = [r[kernel][(causal, layout)] for r in ranks]
    for name, dim in (("out", 2), ("lse", 2), ("dq", 2), ("dk", 2), ("dv", 2)):
        full = unshard_sequence([g[name] for g in got], layout, dim=dim)
        assert_close_to_scale(full, want[name], msg=f"cp={len(ranks)} {layout} causal={causal} {name}")
        assert _worst_units(full, want[name]) < ROUNDOFF_K
    assert all(g["lse"].dtype == torch.float32 and torch.isfinite(g["lse"]).all() for g in got)


@pytest.mark.parametrize("causal,layout", CASES)
def test_ring_comm_log_is_theory(ranks, causal, layout):
    cp = len(ranks)
    theory = ring_kv_bytes(B, H, S, HD, cp)
    for rank, r in enumerate(ranks):
        got = r["attention"][(causal, layout)]
        nxt, prev = (rank + 1) % cp, (rank - 1) % cp
        fwd, bwd = got["forward"], got["backward"]
        assert [(t, op, n, p) for t, op, n, p, *_ in fwd if op == "send"] == [(CP_KV_TAG, "send", theory["kv_message"],
                                                                              nxt)] * (cp - 1)
        assert [(t, op, n, p) for t, op, n, p, *_ in fwd if op == "recv"] == [(CP_KV_TAG, "recv", theory["kv_message"],
                                                                              prev)] * (cp - 1)
        assert sum(n for _, op, n, *_ in fwd if op == "send") == theory["forward"]
        sends = [(t, n, p) for t, op, n, p, *_ in bwd if op == "send"]
        recvs = [(t, n, p) for t, op, n, p, *_ in bwd if op == "recv"]
        want = [(CP_KV_TAG, theory["kv_message"], nxt)] * theory["backward_kv_messages"] + \
            [(CP_GRAD_TAG, theory["grad_message"], nxt)] * theory["backward_grad_messages"]
        assert sorted(sends) == sorted(want)
        assert sorted(recvs) == sorted((t, n, prev) for t, n, _ in sends)
        assert sum(n for _, n, _ in sends) == theory["backward"] == sum(n for _, n, _ in recvs)


def test_ring_issues_each_hop_before_computing_the_block(ranks):
    """Zigzag computes a block at every step: step s's send starts before block s is computed and its receive is
    waited for after, so the hop is in flight across the compute (the timeline's overlap)."""
    cp = len(ranks)
    for r in ranks:
        got = r["attention"][(True, "zigzag")]
        forward_spans = [sp for sp in got["spans"] if sp[0] == "forward"]
        assert len(forward_spans) == cp and sum(sp[0] == "backward" for sp in got["spans"]) == cp
        sends = [e for e in got["forward"] if e[1] == "send"]
        recvs = [e for e in got["forward"] if e[1] == "recv"]
        for step in range(cp - 1):
            (_, s_t0, s_t1), send, recv = forward_spans[step], sends[step], recvs[step]
            assert send[4] <= s_t0 and recv[4] <= s_t0, f"step {step}: hop issued after the block's compute began"
            assert recv[5] >= s_t1, f"step {step}: receive waited for before the block was computed"


@pytest.mark.parametrize("causal,layout", CASES)
def test_ring_counts_its_work_and_saved_bytes(ranks, causal, layout):
    cp = len(ranks)
    saved = activation_memory_per_rank(B, H, S, HD, cp)["saved"]
    for rank, r in enumerate(ranks):
        got = r["attention"][(causal, layout)]
        stats = got["stats"]
        assert stats["pairs_visible"] == attention_work(S, cp, layout, causal)[rank]
        assert stats["pairs_computed"] == computed_pairs(S, cp, layout, causal)[rank]
        assert stats["skipped"] == skipped_blocks(S, cp, layout, causal)[rank]
        assert stats["blocks"] + stats["skipped"] == cp
        assert got["saved"] == saved  # q, k, v, out (fp32) and the lse of this rank's S/cp tokens


# -- the GPT -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_context_parallel_gpt_matches_single_process(ranks, layout):
    want_loss, want_grads = _reference_gpt()
    for rank, r in enumerate(ranks):
        got = r["gpt"][layout]
        assert_close_to_scale(got["loss"], want_loss, msg="loss")
        assert_all_close_to_scale(got["grads"], want_grads, msg=f"cp={len(ranks)} {layout} rank {rank} grad ")


def test_context_parallel_gpt_comm_log_is_theory(ranks):
    cp = len(ranks)
    theory = ring_kv_bytes(GPT_BATCH, TINY.n_head, TINY.seq_len, TINY.head_dim, cp)
    for r in ranks:
        for layout in LAYOUTS:
            got = r["gpt"][layout]
            assert {e[0] for e in got["forward"]} == {CP_KV_TAG}  # nothing but the K/V ring in forward
            for phase in ("forward", "backward"):
                sent = sum(n for _, op, n, *_ in got[phase] if op == "send")
                assert sent == TINY.n_layer * theory[phase], (layout, phase)


# -- one rank ----------------------------------------------------------------------------------------------------

def test_one_rank_is_plain_attention_bit_for_bit():
    g = _global_inputs()
    for causal in (True, False):
        want = F.scaled_dot_product_attention(g["q"], g["k"], g["v"], is_causal=causal)
        assert torch.equal(ring_attention(g["q"], g["k"], g["v"], None, causal=causal), want)
    model, plain = apply_context_parallel(build_gpt(TINY, seed=0), None), build_gpt(TINY, seed=0)
    x, y = gpt_batch(0, GPT_BATCH, seq_len=TINY.seq_len)
    assert torch.equal(model(x, y), plain(x, y))
    assert torch.equal(plain(x, y, positions=torch.arange(TINY.seq_len)), plain(x, y))


@pytest.mark.parametrize("causal", [True, False])
def test_one_rank_lse_path_matches_full_attention(causal):
    g, want = _global_inputs(), _reference(causal)
    q, k, v = (g[n].clone().requires_grad_() for n in "qkv")
    out, lse = ring_attention_with_lse(q, k, v, None, causal=causal)
    ((out * g["probe_out"]).sum() + (lse * g["probe_lse"]).sum()).backward()
    for name, got in (("out", out), ("lse", lse), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert_close_to_scale(got.detach(), want[name], msg=name)


def test_a_row_with_no_visible_key_in_a_block_stays_finite():
    """Queries at 0, 1 against keys at 1, 2: query 0 sees nothing in this block (m stays -inf, l 0, no NaN);
    after a block with key 0 its result is that key's value exactly."""
    qs, k, v = _seeded(1, 1, 2, 4, seed=6), _seeded(1, 1, 2, 4, seed=7), _seeded(1, 1, 2, 4, seed=8)
    q_pos, k_pos = torch.tensor([0, 1]), torch.tensor([1, 2])
    m, row_sum, acc = torch.full((1, 1, 2), -math.inf), torch.zeros(1, 1, 2), torch.zeros(1, 1, 2, 4)
    cp_mod._forward_block(qs, k, v, (0, 2, 0, 2, True, 1), q_pos, k_pos, m, row_sum, acc)
    assert m[0, 0, 0] == -math.inf and row_sum[0, 0, 0] == 0 and torch.isfinite(acc).all()
    cp_mod._forward_block(qs, k[..., :1, :], v[..., :1, :], (0, 2, 0, 1, True, 2), q_pos, torch.tensor([0]), m,
                          row_sum, acc)
    assert torch.isfinite(m).all() and torch.equal(acc[0, 0, 0] / row_sum[0, 0, 0], v[0, 0, 0])


def test_the_fused_kernel_keeps_a_blind_row_out_of_the_merge():
    """The fused CPU kernel reports lse 0 and output 0 for a row that sees no key; the merge must give that row
    weight 0 (lse -inf), so after the block holding key 0 the row is that key's value exactly."""
    q, k, v = _seeded(1, 1, 2, 4, seed=6), _seeded(1, 1, 2, 4, seed=7), _seeded(1, 1, 2, 4, seed=8)
    q_pos, k_pos = torch.tensor([0, 1]), torch.tensor([1, 2])
    out, lse = torch.zeros(1, 1, 2, 4), torch.full((1, 1, 2), -math.inf)
    cp_mod._forward_block_fused(q, k, v, (0, 2, 0, 2, True, 1), q_pos, k_pos, out, lse)
    assert lse[0, 0, 0] == -math.inf and torch.isfinite(lse[0, 0, 1]) and torch.isfinite(out).all()
    cp_mod._forward_block_fused(q, k[..., :1, :], v[..., :1, :], (0, 2, 0, 1, True, 2), q_pos, torch.tensor([0]),
                                out, lse)
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0], rtol=0, atol=4 * eps())  # one key: softmax weight 1


# -- layouts, balance, theory, errors ----------------------------------------------------------------------------

def test_layouts_hold_the_right_tokens():
    assert [chunk_positions(16, 4, r, "zigzag", "cpu").tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert [chunk_positions(8, 2, r, "contiguous", "cpu").tolist() for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert chunk_positions(7, 1, 0, "zigzag", "cpu").tolist() == list(range(7))  # one rank: anything goes
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    for layout in LAYOUTS:
        for cp in (1, 2, 3, 4):
            shards = [shard_sequence(x, cp, r, layout) for r in range(cp)]
            assert torch.equal(unshard_sequence(shards, layout), x)
    idx, targets, positions = shard_inputs(x[..., 0], x[..., 1], None, "zigzag")  # one process: everything
    assert torch.equal(idx, x[..., 0]) and torch.equal(positions, torch.arange(24))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_causal_work_contiguous_does_not(cp):
    seq_len = 2 * cp * 64
    zig, con = attention_work(seq_len, cp, "zigzag"), attention_work(seq_len, cp, "contiguous")
    assert sum(zig) == sum(con) == seq_len * (seq_len + 1) // 2
    assert max(zig) / min(zig) <= 1.0 + 1e-12
    assert max(con) / min(con) == pytest.approx(2 * cp - 1, rel=0.02)  # → 2cp−1 as S/cp grows (L/(L+1))
    c = seq_len // (2 * cp)
    assert zig == [(2 * cp - 1) * c * c + c * (c + 1)] * cp
    # What the ring multiplies: zigzag a diagonal block plus cp−1 half blocks everywhere; contiguous r+1 blocks.
    local = seq_len // cp
    assert computed_pairs(seq_len, cp, "zigzag") == [local * local * (cp + 1) // 2] * cp
    assert computed_pairs(seq_len, cp, "contiguous") == [(r + 1) * local * local for r in range(cp)]
    assert skipped_blocks(seq_len, cp, "contiguous") == [cp - 1 - r for r in range(cp)]
    assert attention_work(seq_len, cp, "zigzag", causal=False) == [seq_len * local] * cp


def test_theory_hand_checked():
    b, h, s, hd, cp = 2, 4, 1024, 64, 4
    kv = 2 * b * h * (s // cp) * hd * 4  # 1 MiB: K and V of 256 tokens
    assert ring_kv_bytes(b, h, s, hd, cp) == {
        "kv_message": kv, "grad_message": kv, "forward_messages": 3, "backward_kv_messages": 3,
        "backward_grad_messages": 4, "forward": 3 * kv, "backward": 7 * kv, "total": 10 * kv}
    assert ring_kv_bytes(b, h, s, hd, cp, bytes_per_value=2)["backward"] == 3 * kv // 2 + 4 * kv
    assert ring_kv_bytes(b, h, s, hd, 1)["total"] == 0
    # The ring hides a hop once S/cp >= F·bytes/(2·BW) tokens (full block); a zigzag causal step is half a block.
    full = kv_transfer_vs_compute(1, 8, 8 * 8000, 128, 8, 50, 400e12, bytes_per_value=2, causal=False)
    assert full["min_tokens_per_rank"] == pytest.approx(8000) and full["compute_over_transfer"] == pytest.approx(1)
    half = kv_transfer_vs_compute(1, 8, 8 * 8000, 128, 8, 50, 400e12, bytes_per_value=2)
    assert half["min_tokens_per_rank"] == pytest.approx(16000) and not half["hidden"]
    assert kv_transfer_vs_compute(1, 8, 8 * 32000, 128, 8, 50, 400e12, bytes_per_value=2)["hidden"]
    one, four = (activation_memory_per_rank(b, h, s, hd, n, n_layer=24) for n in (1, 4))
    assert one["saved"] == 4 * four["saved"] and one["score_block"] == 16 * four["score_block"]
    assert one["full_scores"] == four["full_scores"] == one["score_block"]


def test_bad_inputs_are_errors():
    with pytest.raises(ValueError, match=r"seq_len=30 is not divisible into 2\*cp=8 chunks .*'zigzag'.*cp values "
                                         r"that split it: \[1, 3, 5, 15\]"):
        check_cp(30, 4, "zigzag")
    with pytest.raises(ValueError, match=r"seq_len=30 is not divisible into cp=4 chunks .*cp values that split it: "
                                         r"\[1, 2, 3, 5, 6, 10, 15, 30\]"):
        check_cp(30, 4, "contiguous")
    with pytest.raises(ValueError, match=r"unknown context-parallel layout 'striped'; valid layouts: zigzag, "
                                         r"contiguous"):
        check_cp(32, 2, "striped")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=r"cp must be a positive int"):
            check_cp(32, bad, "zigzag")
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, cp=2\)"):
        chunk_positions(32, 2, 2, "zigzag", "cpu")
    g = _global_inputs()
    with pytest.raises(ValueError, match="one shape"):
        ring_attention(g["q"], g["k"][..., :4, :], g["v"])
    with pytest.raises(ValueError, match="unknown context-parallel layout"):
        apply_context_parallel(build_gpt(TINY), None, layout="striped")
    with pytest.raises(ValueError, match="no CausalSelfAttention"):
        apply_context_parallel(ToyMLP(), None)
