"""Regenerate notebooks/00_launching_ranks.ipynb (stored without outputs): python scripts/make_notebook_00.py"""
from pathlib import Path

import nbformat as nbf


def keep_ids(cells, path):
    """Reuse the stored notebook's cell ids: a cell with unchanged source keeps its id, an edited one the id at its position."""
    if not path.exists():
        return
    old = nbf.read(path, as_version=4).cells
    by_source, used = {c.source: c.id for c in old}, set()
    for c in cells:
        if by_source.get(c.source) not in (None, *used):
            c.id = by_source[c.source]
            used.add(c.id)
    for i, c in enumerate(cells):
        if c.id not in used and i < len(old) and old[i].cell_type == c.cell_type and old[i].id not in used:
            c.id = old[i].id
            used.add(c.id)


nb = nbf.v4.new_notebook()
md = nbf.v4.new_markdown_cell
code = nbf.v4.new_code_cell
cells = [
md("""# 00 · Launching ranks

**The question:** what are *ranks*, *process groups* and the *five collectives* that every distributed
training strategy is built from?

In this notebook you start real `torch.distributed` processes from a cell, watch each collective change
what every rank holds, and look at a **measured** timeline of what each rank did and when."""),
code("""# Parameters (papermill can override these)
WORLD_SIZE = 4
CHUNK = 2          # elements per rank in the reduce-scatter / all-gather examples
TIMEOUT_S = 30.0   # every collective gives up after this long instead of hanging
LEARNER_SEED = None  # orders the quiz options; None means $WORKBENCH_LEARNER or your login name
QUIZ_ANSWERS = {}    # headless grading: {"question id": "option text" or a number}""", metadata={"tags": ["parameters"]}),
md("""## What do I have?

Before starting any ranks, see what this machine offers: the torch build and its backends, the GPUs, the
cores, the memory, and how many ranks make sense on each backend. `WORLD_SIZE` in the parameters cell is the
number of ranks every `launch` below starts: it runs on NCCL only when at least `WORLD_SIZE` GPUs are
visible, otherwise on gloo, where up to the recommended number each rank has a core of its own (the default
4 still runs on fewer cores, the ranks just take turns) and the memory ceiling is the hard limit."""),
code("""from workbench.environment import describe_environment, format_environment; print(format_environment(describe_environment()))"""),
md("""## 1. Ranks are processes

`workbench.launch(fn, world_size)` starts `world_size` processes (the **ranks**), connects them into one
**process group** (gloo on CPU, NCCL on GPUs), calls `fn` on every rank and returns what each rank
returned, in rank order. The function can be defined right here in the notebook."""),
code("""import os
import torch
import torch.distributed as dist
import workbench
from workbench import comm, launch

def who_am_i():
    return dict(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=dist.get_backend(),
                pid=os.getpid())

for row in launch(who_am_i, WORLD_SIZE, timeout=TIMEOUT_S):
    print(row)"""),
md("""Every rank ran the same function but got a different `rank`: that number is how a rank knows
which part of the work is its own. Anything a rank prints appears here prefixed with `[rank r]`."""),
code("""def say_hello():
    print(f"hello from rank {dist.get_rank()} of {dist.get_world_size()}")

_ = launch(say_hello, WORLD_SIZE, timeout=TIMEOUT_S)"""),
md("""## 2. The five collectives

A **collective** is an operation every rank of a group calls together. We run each one on small tensors
and record what every rank holds *before* and *after*:

| collective | what it does |
|---|---|
| broadcast | rank 0's tensor is copied to every rank |
| all-reduce | every rank ends with the sum of all ranks' tensors |
| reduce-scatter | the sum is computed, but each rank keeps only its own chunk of it |
| all-gather | every rank's chunk is concatenated on every rank |
| send / recv | point-to-point: one rank sends, one receives |

Each call goes through `workbench.comm`, which logs the op, its bytes, the group and the start/end time."""),
code("""from workbench import trace

def five_collectives(chunk):
    rank, world = dist.get_rank(), dist.get_world_size()
    seen = {}

    def record(name, before, run):
        with trace.span(name, "comm"):
            after = run()
        seen[name] = (before, after.tolist())

    t = torch.full((2,), 7.0) if rank == 0 else torch.zeros(2)
    record("broadcast", t.tolist(), lambda: (comm.broadcast(t, src=0), t)[1])

    t = torch.full((2,), float(rank + 1))
    record("all_reduce", t.tolist(), lambda: (comm.all_reduce(t), t)[1])

    full = torch.arange(world * chunk, dtype=torch.float32) + 100 * rank
    mine = torch.empty(chunk)
    record("reduce_scatter", full.tolist(), lambda: (comm.reduce_scatter(mine, full), mine)[1])

    piece = torch.full((chunk,), float(rank))
    gathered = torch.empty(world * chunk)
    record("all_gather", piece.tolist(), lambda: (comm.all_gather(gathered, piece), gathered)[1])

    # send/recv around a ring: even ranks send first, odd ranks receive first, so no one waits forever
    out, inbox = torch.full((1,), float(rank)), torch.zeros(1)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    def ring():
        if rank % 2 == 0:
            comm.send(out, nxt); comm.recv(inbox, prv)
        else:
            comm.recv(inbox, prv); comm.send(out, nxt)
        return inbox
    record("send_recv", out.tolist(), ring)
    return seen

results = launch(five_collectives, WORLD_SIZE, CHUNK, timeout=TIMEOUT_S)
for name in results[0]:
    print(f"--- {name}")
    for rank, seen in enumerate(results):
        before, after = seen[name]
        print(f"  rank {rank}: before {before}  ->  after {after}")"""),
md("""Check a few by hand: after **all-reduce** every rank holds 1+2+…+N; after **reduce-scatter** rank r
holds only chunk r of the sum; after **all-gather** every rank holds every rank's piece; in the ring of
**send/recv**, rank r received from rank r−1."""),
md("""## 3. What each rank did, measured

`launch` also returns each rank's **trace**: named spans and every collective with its bytes and start/end
time. Hover over the bars. Collectives are synchronising: a rank that arrives early waits for the last one."""),
code("""from workbench.viz import comm_table, timeline

fig = timeline(results.traces, title="five collectives on %d ranks (measured)" % WORLD_SIZE, unit="ms")
fig.show()"""),
code("""rows = comm_table(results.traces)
print(f"{'rank':>4} {'op':<15} {'count':>5} {'bytes':>8} {'bus bytes':>10} {'ms':>8}")
for r in rows:
    if r["rank"] == 0:
        print(f"{r['rank']:>4} {r['op']:<15} {r['count']:>5} {r['MiB'] * 2**20:>8.0f} {r['bus_MiB'] * 2**20:>10.0f} {r['ms']:>8.2f}")"""),
md("""*Bytes* is the size of the full tensor each op works on; *bus bytes* is what each rank actually sends
under the ring algorithm: an all-reduce of S bytes sends 2(N−1)/N·S per rank, reduce-scatter and
all-gather (N−1)/N·S each. Notebook 02 shows where those factors come from."""),
md("""## 4. Process groups and the mesh

A collective can run over a **subset** of the ranks. `workbench.Mesh` arranges the ranks on a grid
(data-, tensor-, pipeline-parallel axes) and gives each rank one process group per axis."""),
code("""from workbench import Mesh

def mesh_demo():
    mesh = Mesh(dp=2, tp=2)
    x = torch.tensor([float(dist.get_rank())])
    comm.all_reduce(x, group=mesh.tp_group)
    return mesh.coords, mesh.ranks("tp"), mesh.ranks("dp"), x.item()

if WORLD_SIZE == 4:
    for rank, (coords, tp, dp, total) in enumerate(launch(mesh_demo, 4, timeout=TIMEOUT_S)):
        print(f"rank {rank}: dp={coords['dp']} tp={coords['tp']}  tp group {tp}  dp group {dp}  "
              f"sum over my tp group = {total}")"""),
md("""## 5. When a rank fails

A rank that raises, dies, or never joins a collective does not hang the notebook: the other ranks are
stopped and you get a `RankError` naming the rank, with its traceback."""),
code("""def one_rank_fails():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 read a corrupt batch")
    comm.all_reduce(torch.ones(1))

try:
    launch(one_rank_fails, WORLD_SIZE, timeout=TIMEOUT_S)
except workbench.RankError as err:
    print("caught:", str(err).splitlines()[0])
    print("failed rank:", err.rank)"""),
code("""import time

def rank_1_never_joins():
    if dist.get_rank() == 1:
        time.sleep(60)          # busy elsewhere: never calls the all-reduce
    comm.all_reduce(torch.ones(1))

t0 = time.time()
try:
    launch(rank_1_never_joins, WORLD_SIZE, timeout=2)
except workbench.RankError as err:
    print(f"after {time.time() - t0:.1f} s:", "\\n".join(str(err).splitlines()[:2]))"""),
md("""## What just happened

* `launch` started real processes; each got a **rank** and joined one **process group**.
* The five collectives moved data between them; every call was **logged** with its bytes and timing.
* The **timeline** is measured: it is the raw material for every figure in the later notebooks (DDP's
  overlap, ZeRO's all-gathers, pipeline bubbles).
* Failures end in a clear error within the timeout, never a hang."""),
md("""## Knowledge check

Answer each question and press **check**. Every option has its own explanation, the tempting wrong ones too, shown
once you have answered. The options are shuffled for your `LEARNER_SEED`, and the answers are stored only as salted
hashes, so the collapsed cell below does not give them away (its feedback strings are best read after answering)."""),
code("""from workbench.widgets.quiz import Choice, Numeric, QuizBook

QUIZ = QuizBook("00 · launching ranks", seed=LEARNER_SEED)
QUIZ.show(
    Numeric("nb00.allreduce-value",
            "Eight ranks each hold a one-element tensor filled with rank + 1 (1, 2, …, 8). After all_reduce "
            "with SUM, what value does rank 5 hold?",
            abs_tol=0, key="num:2YfhwzG0xyhiqirb",
            why="All-reduce leaves the full reduction on every rank, whatever that rank contributed: add up "
                "all eight inputs."),
    Choice("nb00.own-chunk",
           "Which collective leaves each rank with only its own chunk of the sum over all ranks?",
           {
               "all-gather":
                   "All-gather sums nothing: it concatenates every rank's chunk, so every rank ends with all "
                   "of them.",
               "all-reduce":
                   "All-reduce leaves the whole sum on every rank, not one chunk of it.",
               "point-to-point send / recv":
                   "Send/recv has one sender and one receiver: nothing is summed over the group.",
               "reduce-scatter":
                   "Reduce-scatter sums over all ranks and hands rank r only chunk r of that sum; ZeRO uses "
                   "it for gradients, and a ring all-reduce is a reduce-scatter followed by an all-gather.",
           },
           key="f32d4f9b96224ee0dad5"),
    Choice("nb00.timeout",
           "Why does every process group in this notebook have a timeout?",
           {
               "so a collective that one rank never joins fails with an error instead of hanging":
                   "A collective waits for every member of its group; with a timeout the waiting ranks fail "
                   "with an error that names the missing rank, and `launch` ends within the timeout.",
               "so that collectives run faster by giving up on slow ranks early":
                   "A timeout changes nothing while every rank joins in time, and it skips no one: it only "
                   "decides what happens when a rank never joins.",
               "because NCCL and gloo refuse to create a process group without an explicit timeout":
                   "Both have a default (30 minutes or more); the notebook shortens it so a demo failure ends "
                   "in seconds.",
               "to cap the memory a collective may hold while it waits for its peers":
                   "A timeout bounds how long a rank waits for its peers, not how much memory anything takes.",
           },
           key="76fb2b07a88192d77210"),
    Choice("nb00.collective-vs-p2p",
           "What makes all_reduce a collective, and send a point-to-point operation?",
           {
               "a collective moves more bytes than any point-to-point send can, so it needs its own algorithm":
                   "Size is not the difference: a broadcast of 4 bytes is a collective, a send of 1 GB is "
                   "not.",
               "collectives run only on GPUs with NCCL, while send and recv also work on the CPU with gloo":
                   "This notebook runs every collective on the CPU, over gloo.",
               "every rank of the group must call it, in the same order; a send involves just two ranks":
                   "Collectives are matched by the order of the calls on each rank, so every member must make "
                   "the same calls; a send is matched only with the receive of the one peer it names.",
               "a collective is computed by one coordinating rank that then sends the result to the others":
                   "There is no coordinator: every rank runs its part of the algorithm (ring, tree) and "
                   "exchanges messages with its peers.",
           },
           key="c72e24c9617ac018d6c9"),
)""", metadata={'jupyter': {'source_hidden': True}, 'tags': ['quiz']}),
md("""### Score

The score below updates as you answer. In a headless run (papermill), pass your answers as the `QUIZ_ANSWERS`
parameter, `{"question id": "option text" or a number}`; the ids are printed with the questions."""),
code("""QUIZ.answer_all(QUIZ_ANSWERS)  # answers given as a parameter (headless runs); the widgets above add yours
QUIZ.scoreboard()"""),
]
nb.cells = cells
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
OUT = Path(__file__).resolve().parent.parent / "notebooks" / "00_launching_ranks.ipynb"
keep_ids(nb.cells, OUT)
nbf.write(nb, OUT)
