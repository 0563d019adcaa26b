"""Chosen DAPPLE plans on every paper profile x preset (and the speed benchmark's synthetic chains), as data.

``python benchmarks/planner_identity.py --write planner_identity.json`` records the plans;
``--check planner_identity.json`` replans and lists every case whose plan differs (exit status 1),
so a change that should only make the planner faster can be shown to choose the same plans.
Planning time is left out of the record (it is the only field allowed to change).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from planner_speed import synthetic_chain
from planner_study import CLUSTERS, MODELS, PROFILES, SWEEP_MODELS

from fxpipe.core.chain import CostChain, build_chain
from fxpipe.core.cluster import Cluster, compact_cluster, parse_cluster
from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.request import PlanningError
from fxpipe.passes.profiles_io import read_profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from planner_cases import random_case  # noqa: E402

NUM_RANDOM_CASES = 200  # the oracle benchmark's random chains (tests/planner_cases.py)


def cases(with_large: bool) -> list[tuple[str, CostChain, str | Cluster, int]]:
    found: list[tuple[str, CostChain, str | Cluster, int]] = []
    for file, pbs, paper_batch in MODELS:
        chain = build_chain(read_profile(PROFILES / file, profile_batch_size=pbs), max_blocks=64)
        model = file.split("-pbs")[0]
        batches = [paper_batch // 4, paper_batch, paper_batch * 4] if model in SWEEP_MODELS else [paper_batch]
        found.extend((model, chain, cluster, batch) for cluster in CLUSTERS for batch in batches)
    for num_blocks in (16, 64, 256, 1000):
        for spec in ("2x8", "16x8", "128x8"):
            if spec == "128x8" and not (with_large and num_blocks in (256, 1000)):
                continue
            found.append((f"synthetic-{num_blocks}", synthetic_chain(num_blocks), spec, 4096))
    for seed in range(NUM_RANDOM_CASES):
        chain, cluster, batch = random_case(seed)
        found.append((f"random-{seed}", chain, cluster, batch))
    return found


def plan_record(chain: CostChain, cluster_spec: str | Cluster, batch: int) -> dict[str, Any]:
    if isinstance(cluster_spec, Cluster):
        cluster = cluster_spec
    elif cluster_spec.startswith("dapple"):
        cluster = parse_cluster(cluster_spec)
    else:
        cluster = compact_cluster(*map(int, cluster_spec.split("x")), "v100")
    try:
        plan = partition(chain, cluster, batch)
    except PlanningError as error:
        return {"error": type(error).__name__}
    return json.loads(json.dumps(plan.with_updates(planning_time_s=0.0).to_json_dict()))  # as read back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", help="record the plans to this JSON file")
    group.add_argument("--check", help="compare against plans recorded in this JSON file")
    parser.add_argument("--no-large", action="store_true", help="skip the 1,024-device synthetic cases")
    args = parser.parse_args()
    reference = json.loads(Path(args.check).read_text()) if args.check else {}
    records: dict[str, Any] = {}
    differing = []
    for name, chain, spec, batch in cases(not args.no_large):
        key = f"{name} {spec if isinstance(spec, str) else spec.name} {batch}"
        start = time.perf_counter()
        records[key] = plan_record(chain, spec, batch)
        same = "" if not args.check else ("same" if reference.get(key) == records[key] else "DIFFERENT")
        if same == "DIFFERENT":
            differing.append(key)
        print(f"{key:32s} {time.perf_counter() - start:7.2f} s {records[key].get('layout', '-')} {same}", flush=True)
    if args.write:
        Path(args.write).write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
        return
    print(f"{len(records) - len(differing)} of {len(records)} plans identical; differing: {differing}")
    sys.exit(1 if differing else 0)


if __name__ == "__main__":
    main()
