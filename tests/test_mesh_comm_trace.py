"""Mesh layout and validation, comm's logging and identities, tracer records, torchrun mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from workbench import Mesh, MeshShape, comm, launch, trace

pytestmark = pytest.mark.timeout(120)


def test_mesh_shape_layout_is_megatron_order() -> None:
    shape = MeshShape(dp=2, tp=2, pp=2)
    assert shape.world_size == 8
    assert shape.coords(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert shape.axis_ranks("tp", 5) == [4, 5]
    assert shape.axis_ranks("dp", 5) == [5, 7]
    assert shape.axis_ranks("pp", 5) == [1, 5]
    assert shape.all_axis_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert all(shape.rank_of(**shape.coords(r)) == r for r in range(8))


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=0), "dp must be a positive int"),
    (dict(dp=-2), "dp must be a positive int"),
    (dict(tp=1.5), "tp must be a positive int"),
    (dict(dp=3, world_size=4), "has 3 ranks but world size is 4"),
])
def test_mesh_rejects_bad_shapes(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Mesh(**kwargs)


def test_mesh_without_process_group_is_single_rank() -> None:
    mesh = Mesh()
    assert mesh.dp_size == 1 and mesh.dp_group is None and mesh.coords["tp"] == 0
    t = torch.arange(4.0)
    comm.all_reduce(t, group=mesh.dp_group, op="avg")
    assert t.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="unknown mesh axis"):
        mesh.group("xp")


def _mesh_groups() -> dict:
    mesh = Mesh(dp=2, tp=2)
    rank = float(dist.get_rank())
    dp_sum = torch.tensor([rank])
    comm.all_reduce(dp_sum, group=mesh.dp_group)
    tp_gather = torch.zeros(2)
    comm.all_gather(tp_gather, torch.tensor([rank]), group=mesh.tp_group)
    rs_out = torch.zeros(1)
    comm.reduce_scatter(rs_out, torch.tensor([rank, 10 * rank]), op="avg", group=mesh.tp_group)
    src = comm.global_rank(mesh.dp_group, 0)
    b = torch.tensor([rank])
    comm.broadcast(b, src=src, group=mesh.dp_group)
    return {"coords": mesh.coords, "dp": dp_sum.item(), "tp": tp_gather.tolist(), "rs": rs_out.item(),
            "bcast": b.item(), "dp_ranks": mesh.ranks("dp")}


def test_mesh_groups_on_four_ranks() -> None:
    results = launch(_mesh_groups, 4, timeout=30)
    assert [r["dp"] for r in results] == [2, 4, 2, 4]        # {0,2} and {1,3}
    assert [r["tp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["rs"] for r in results] == [0.5, 5.0, 2.5, 25.0]  # avg over tp pair, chunk by tp index
    assert [r["bcast"] for r in results] == [0, 1, 0, 1]
    ops = [e.op for e in results.traces[0].comms]
    assert ops == ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
    ag = results.traces[0].comms[1]
    assert ag.group == (0, 1) and ag.nbytes == 8 and ag.bus_bytes == 4


def test_mesh_invalid_inside_launch_is_rank_error() -> None:
    from workbench import RankError

    with pytest.raises(RankError, match="has 3 ranks but world size is 2"):
        launch(lambda: Mesh(dp=3), 2, timeout=20)


def test_bus_bytes_follow_ring_accounting() -> None:
    assert comm.bus_bytes("all_reduce", 1000, 4) == 1500
    assert comm.bus_bytes("reduce_scatter", 1000, 4) == 750
    assert comm.bus_bytes("all_gather", 1000, 1) == 0


def test_async_ops_log_when_waited() -> None:
    def fn() -> tuple[float, float]:
        t = torch.ones(1000)
        work = comm.all_reduce(t, async_op=True, tag="grad")
        work.wait()
        work.wait()  # idempotent
        event = trace.current().trace.comms[-1]
        return event.t1 - event.t0, float(event.async_op)

    results = launch(fn, 2)
    assert all(r[1] == 1.0 and r[0] >= 0 for r in results)
    assert len(results.traces[0].comms) == 1 and results.traces[0].comms[0].tag == "grad"


def test_all_reduce_coalesced_is_one_logged_message_and_leaves_inputs_alone() -> None:
    def fn() -> list:
        rank = comm.group_rank()
        a, b = torch.full((2, 3), rank + 1.0), torch.full((4,), 10.0 * (rank + 1))
        summed = comm.all_reduce_coalesced([a, b], tag="sp_grads")
        return [a.clone(), summed[0].clone(), summed[1].clone()]

    results = launch(fn, 2)
    a0, sa, sb = results[0]
    assert torch.equal(a0, torch.ones(2, 3))  # the input is untouched
    assert sa.shape == (2, 3) and torch.equal(sa, torch.full((2, 3), 3.0)) and torch.equal(sb, torch.full((4,), 30.0))
    [event] = results.traces[0].comms
    assert event.op == "all_reduce" and event.tag == "sp_grads" and event.nbytes == 10 * 4


def test_tracer_spans_ledger_and_activations() -> None:
    with trace.tracing(rank=0, world_size=1) as tracer:
        tracer.step = 3
        with trace.span("forward", "forward"):
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
            with tracer.activations():
                loss = model(torch.randn(5, 8)).sum()
        saved = tracer.memory.current["activations"]
        loss.backward()
        tracer.release_activations()
        trace.ledger_set("parameters", trace.tensor_bytes(model.parameters()))
    assert tracer.trace.spans[0].name == "forward" and tracer.trace.spans[0].step == 3
    # input (5x8), hidden pre-activation / relu output (5x16): parameters excluded
    assert 5 * 16 * 4 <= saved <= (5 * 8 + 3 * 5 * 16) * 4
    assert tracer.memory.peak["activations"] == saved and tracer.memory.current["activations"] == 0
    assert tracer.memory.current["parameters"] == (8 * 16 + 16 + 16 * 4 + 4) * 4
    with pytest.raises(ValueError, match="unknown memory category"):
        tracer.memory.set("weights", 1)
    assert trace.current() is None
    with trace.span("nothing"):  # no active tracer: a no-op
        pass


def test_trace_round_trips_through_json() -> None:
    results = launch(_mesh_groups, 4, timeout=30)
    d = json.loads(json.dumps(results.traces[2].to_dict()))
    again = trace.Trace.from_dict(d)
    assert again.comms == results.traces[2].comms


TORCHRUN_SCRIPT = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from workbench import launch, comm

    def fn():
        t = torch.tensor([float(dist.get_rank() + 1)])
        comm.all_reduce(t)
        return dist.get_rank(), t.item()

    if __name__ == "__main__":
        results = launch(fn, 2)
        # one file per rank: two processes printing to one pipe may interleave their lines
        with open(os.path.join(sys.argv[1], "rank%s.txt" % os.environ["RANK"]), "w") as f:
            f.write("RESULT %s %s %s" % (dist.is_initialized(), list(results), len(results.traces)))
""")


# torchrun's own launcher: the extended lane (tests/test_train_cli.py runs a whole training under torchrun)
@pytest.mark.extended
def test_under_torchrun_runs_for_own_rank(tmp_path) -> None:
    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--standalone", str(script), str(tmp_path)], capture_output=True, text=True, timeout=100,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert lines == ["RESULT False [(0, 3.0), (1, 3.0)] 2"] * 2
