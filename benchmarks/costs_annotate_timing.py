"""Wall time of trace + annotate_costs for a zoo preset on the meta device: python benchmarks/costs_annotate_timing.py bert-48 [cache=0] [num_layers=4]."""

import sys
import time

import torch

import fxpipe.models
import fxpipe.passes

torch.set_num_threads(1)
name = sys.argv[1]
overrides = {key: int(value) for key, value in (arg.split("=") for arg in sys.argv[2:])}
cache = overrides.pop("cache", 1) == 1
start = time.perf_counter()
model, inputs = fxpipe.models.build(name, device="meta", **overrides)
built = time.perf_counter()
gm = fxpipe.passes.trace(model, inputs)
traced = time.perf_counter()
annotated = fxpipe.passes.annotate_costs(gm, cache=cache)
done = time.perf_counter()
print(
    f"{name} {overrides} cache={cache}: nodes={len(gm.graph.nodes)} build={built - start:.1f}s "
    f"trace={traced - built:.1f}s annotate={done - traced:.1f}s mode={annotated.meta['fxpipe.cost_mode'][:30]}"
)
