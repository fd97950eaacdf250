"""Reference solution of lab 08 (labs/08_one_f_one_b.ipynb): the 1F1B action lists.

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
§2.2.1, PipeDream-Flush): rank r runs p−r−1 warm-up forwards, then alternates one forward and one backward,
then drains the backwards it still holds. The last rank (r = p−1) needs no warm-up: it holds the loss, so it
can run each micro-batch's backward right after its forward.
"""

from __future__ import annotations

from workbench.theory.pipeline import Action


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """plan[r]: rank r's actions in order, stage r only; at most p−r micro-batches in flight on rank r."""
    plan = []
    for r in range(p):
        warmup = min(p - r - 1, m)  # forwards in flight before the first gradient can come back
        actions = [Action(r, "F", mb) for mb in range(warmup)]
        for i in range(m - warmup):  # steady state: the next forward, then the oldest micro-batch's backward
            actions += [Action(r, "F", warmup + i), Action(r, "B", i)]
        actions += [Action(r, "B", mb) for mb in range(m - warmup, m)]  # cool-down
        plan.append(actions)
    return plan
