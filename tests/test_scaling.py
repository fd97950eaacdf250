"""theory.scaling: data-parallel efficiency over a cluster's links (issue 20, "Scaling efficiency")."""

from __future__ import annotations

import pytest

from workbench.theory.scaling import allreduce_time, cluster, scaling_curve
from workbench.theory.topology import LINK_PRESETS

NVLINK, IB, ETH = LINK_PRESETS["nvlink"], LINK_PRESETS["infiniband"], LINK_PRESETS["ethernet"]


def test_cluster_fills_nodes_node_major() -> None:
    assert cluster(4, 8, NVLINK, IB).describe() == "1 node x 4 ranks"
    assert cluster(64, 8, NVLINK, IB).describe() == "8 nodes x 8 ranks"
    with pytest.raises(ValueError, match="world=12 ranks do not fill nodes of 8"):
        cluster(12, 8, NVLINK, IB)


def test_allreduce_pays_the_slow_link_only_once_the_ranks_leave_a_node() -> None:
    s = 1e9
    assert allreduce_time(s, cluster(1, 8, NVLINK, IB)) == 0.0
    assert allreduce_time(s, cluster(8, 8, NVLINK, IB)) == pytest.approx(NVLINK.ring_allreduce(s, 8))
    assert allreduce_time(s, cluster(16, 8, NVLINK, IB)) == pytest.approx(IB.ring_allreduce(s, 16))
    # hierarchical: only S/8 crosses nodes, so it beats the flat ring when the inter-node link is slower
    assert allreduce_time(s, cluster(16, 8, NVLINK, IB), "hierarchical") < 0.3 * allreduce_time(s, cluster(16, 8,
                                                                                                         NVLINK, IB))
    with pytest.raises(ValueError, match="algorithm='tree'; valid: ring, hierarchical"):
        allreduce_time(s, cluster(16, 8, NVLINK, IB), "tree")


def test_weak_scaling_falls_with_size_and_strong_scaling_falls_faster() -> None:
    worlds = [1, 8, 64, 512]
    weak = scaling_curve(1.0, 14e9, worlds, 8, NVLINK, IB, mode="weak")
    strong = scaling_curve(1.0, 14e9, worlds, 8, NVLINK, IB, mode="strong")
    assert weak[0].efficiency == strong[0].efficiency == 1.0  # one rank waits for nobody
    assert [p.efficiency for p in weak] == sorted((p.efficiency for p in weak), reverse=True)
    assert all(s.efficiency < w.efficiency for s, w in zip(strong[1:], weak[1:], strict=True))
    for p in weak:  # the definition, point by point
        assert p.efficiency == pytest.approx(p.compute_s / (p.compute_s + p.allreduce_s))
    hidden = scaling_curve(1.0, 14e9, worlds, 8, NVLINK, IB, mode="weak", overlap=1.0)
    assert all(p.efficiency == 1.0 for p in hidden)  # an all-reduce hidden entirely behind compute costs nothing
    ethernet = scaling_curve(1.0, 14e9, worlds, 8, NVLINK, ETH, mode="weak")
    assert ethernet[-1].efficiency < weak[-1].efficiency  # a slower inter-node link, a lower efficiency


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="linear"), "mode='linear'; valid: strong"),
    (dict(overlap=1.5), "overlap must be in \\[0, 1\\]"),
    (dict(compute_1_s=0), "compute_1_s must be a finite number of seconds > 0"),
    (dict(grad_bytes=-1), "grad_bytes must be a finite number >= 0"),
])
def test_bad_scaling_input_is_named(kwargs: dict, message: str) -> None:
    args = dict(compute_1_s=1.0, grad_bytes=1e9, worlds=[8], ranks_per_node=8, intra=NVLINK, inter=IB) | kwargs
    with pytest.raises(ValueError, match=message):
        scaling_curve(**args)


def test_calc_prints_the_curve_with_its_assumptions(capsys) -> None:
    from workbench.cli import main
    from workbench.theory.models import MODEL_PRESETS
    from workbench.theory.topology import GPU_PEAK_FLOPS

    main(["calc", "--model", "llama-7B", "--nproc", "8", "--batch-size", "64", "--precision", "bf16-mixed",
          "--scaling", "8,64,1024"])
    out = capsys.readouterr().out
    assert "h100-bf16 at 40% MFU" in out and "0% of it overlapped" in out and "8 GPUs per node" in out
    psi = MODEL_PRESETS["llama-7B"]["n_params"]
    compute = 6 * psi * (64 / 8) * 4096 / (GPU_PEAK_FLOPS["h100-bf16"] * 0.4)
    weak = scaling_curve(compute, 2 * psi, [8, 64, 1024], 8, NVLINK, IB, mode="weak")
    for point in weak:  # each printed weak efficiency is theory's, to the printed digit
        assert f"{point.efficiency:.1%}" in out
    assert "strong n/a: more data-parallel ranks than the 64 sequences" in out
    with pytest.raises(SystemExit):
        main(["calc", "--model", "llama-7B", "--scaling", "8,x"])
