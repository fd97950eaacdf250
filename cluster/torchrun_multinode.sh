#!/usr/bin/env bash
# Train workbench's GPT on two (or more) machines by hand: run this same command on every machine.
#
#   machine A:  HEAD=machine-a bash cluster/torchrun_multinode.sh --steps 200 --out runs/multinode
#   machine B:  HEAD=machine-a bash cluster/torchrun_multinode.sh --steps 200 --out runs/multinode
#
# HEAD is a name or address of machine A that every machine can reach; A hosts the rendezvous. The
# arguments are `workbench run` flags (docs/clusters.md), passed through unchanged. Global rank 0 writes
# --out, and it may be on either machine: point --out at a shared filesystem, or look on the machine
# that printed the summary. The rendezvous waits up to JOIN_TIMEOUT seconds for the other machines.
set -euo pipefail

# The machine that hosts the c10d rendezvous store: its agent sees that HEAD names itself and starts
# the store; the others connect to it.
HEAD=${HEAD:?set HEAD to the hostname or address of the first machine (it hosts the rendezvous)}
# How many machines take part: the rendezvous completes when this many agents have joined.
NNODES=${NNODES:-2}
# Any free port on HEAD, open to the other machines; all machines must use the same one.
PORT=${PORT:-29400}
# Names this run's rendezvous; a second run with the same HEAD:PORT needs another id.
RDZV_ID=${RDZV_ID:-workbench}
# How long an agent waits for the others to join before it gives up (seconds).
JOIN_TIMEOUT=${JOIN_TIMEOUT:-300}
# If HEAD is an address that machine A does not take for its own (NAT, a second interface), A never
# starts the store and every agent waits for it: then set IS_HOST=1 on A and IS_HOST=0 elsewhere.
RDZV_CONF="join_timeout=$JOIN_TIMEOUT${IS_HOST:+,is_host=$IS_HOST}"
# The console script's path; as an assignment, a workbench missing from PATH stops here (set -e).
WORKBENCH=$(command -v workbench)

# One rank per GPU (NCCL, the fast path); without GPUs one rank per machine, gloo on the CPU (set
# NPROC_PER_NODE for more; torchrun then gives each rank one thread, OMP_NUM_THREADS=1).
gpus() {
    if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi --list-gpus | wc -l; else echo 0; fi
}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(gpus)}
if [ "$NPROC_PER_NODE" -eq 0 ]; then NPROC_PER_NODE=1; fi

# exec: this shell becomes torchrun, so Ctrl-C or a kill reaches the agent, which stops its ranks.
# No --node-rank: c10d assigns node ranks when the agents meet. --max-restarts 0: a failure fails the run.
exec torchrun \
    --nnodes "$NNODES" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$HEAD:$PORT" \
    --rdzv-id "$RDZV_ID" \
    --rdzv-conf "$RDZV_CONF" \
    --max-restarts 0 \
    "$WORKBENCH" run "$@"
