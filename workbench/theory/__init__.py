"""Theory: what memory and communication *should* cost, in pure Python (no torch, no workbench imports).

Every measured figure in the course is drawn beside a prediction from here:
- `memory`: per-rank bytes of parameters, gradients, master weights, optimizer state (ZeRO paper §5.1) in a named
  mixed-precision layout (`MEMORY_LAYOUTS`: "classic" or the trainer's "amp") and activations (Korthikanti et al.
  2022; SwiGLU and grouped-query attention for Llama shapes);
- `precisions`: the precision names `workbench run`, `workbench calc`, the trainer and the theory share;
- `comm`: α-β (Hockney) times of ring/tree/hierarchical collectives, bus bytes, bytes per DP step, and `Link`,
  the one α-β link type (presets in `parallelism`, fitted by `calibration.fit_ring_allreduce`);
- `models`: exact GPT and Llama parameter counts and named model sizes (Llama-shaped and GPT-shaped);
- `pipeline`: schedules as per-rank action lists, their bubble and in-flight micro-batches;
- `parallelism`: a (dp, tp, pp) layout's memory per rank, traffic per axis and bubble, from all of the above;
- `topology`: nodes of ranks joined by two links (named presets, `parse_link`), and the link each mesh axis crosses.
"""

from workbench.theory.comm import (
    Link,
    all_gather_time,
    bus_bandwidth,
    bus_bytes,
    dp_step_volume,
    fit_alpha_beta,
    hierarchical_allreduce_time,
    reduce_scatter_time,
    ring_allreduce_time,
    tree_allreduce_time,
)
from workbench.theory.memory import (
    MEMORY_LAYOUTS,
    OPTIMIZERS,
    PRECISIONS,
    activation_bytes,
    formula,
    model_state_bytes,
    offloaded_bytes,
    state_bytes_per_param,
    total_bytes,
)
from workbench.theory.models import MODEL_PRESETS, activation_bytes_per_layer, gpt_param_count, llama_param_count
from workbench.theory.parallelism import Layout, analyze_layout, layout_comm, layout_memory
from workbench.theory.precisions import PRECISION_NAMES, canonical_precision
from workbench.theory.topology import LINK_PRESETS, Topology, axis_links, parse_link

__all__ = [
    "LINK_PRESETS", "MEMORY_LAYOUTS", "MODEL_PRESETS", "OPTIMIZERS", "PRECISIONS", "PRECISION_NAMES", "Layout", "Link",
    "Topology", "activation_bytes", "activation_bytes_per_layer", "all_gather_time", "analyze_layout", "axis_links",
    "bus_bandwidth", "bus_bytes", "canonical_precision", "dp_step_volume", "fit_alpha_beta", "formula",
    "gpt_param_count", "hierarchical_allreduce_time", "layout_comm", "layout_memory", "llama_param_count",
    "model_state_bytes", "offloaded_bytes", "parse_link", "reduce_scatter_time", "ring_allreduce_time",
    "state_bytes_per_param", "total_bytes", "tree_allreduce_time",
]
