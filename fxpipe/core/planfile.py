"""Plan files: a plan's JSON plus the cost chain and cluster it was made for, so `simulate`/`show` stand alone."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fxpipe.core.chain import Block, BlockTensorParallel, CostChain, SharedParam
from fxpipe.core.cluster import Cluster
from fxpipe.core.costgraph import ZERO, Affine
from fxpipe.core.jsonvalues import read_field
from fxpipe.core.plan import Plan, PlanError, plan_from_dict


def chain_to_json(chain: CostChain) -> dict[str, Any]:
    return {
        "source": chain.source,
        "input_bytes": chain.input_bytes.to_json(),
        "output_bytes": chain.output_bytes.to_json(),
        "cut_bytes": [cut.to_json() for cut in chain.cut_bytes],
        "blocks": [
            {
                "name": block.name,
                "node_names": list(block.node_names),
                "forward_s": block.forward_s.to_json(),
                "backward_s": block.backward_s.to_json(),
                "param_bytes": block.param_bytes,
                "saved_bytes": block.saved_bytes.to_json(),
                "resaved": [[saver, num_bytes.to_json()] for saver, num_bytes in block.resaved],
                **_tp_to_json(block),
                **({"units": [[unit, num_bytes] for unit, num_bytes in block.units]} if block.units else {}),
                **_attention_core_to_json(block),
            }
            for block in chain.blocks
        ],
        "shared_params": [{"name": shared.name, "num_bytes": shared.num_bytes, "blocks": list(shared.blocks)}
                          for shared in chain.shared_params],
        "loss_saved_bytes": chain.loss_saved_bytes.to_json(),
        "input_saved_bytes": chain.input_saved_bytes.to_json(),
        "target_saved_bytes": chain.target_saved_bytes.to_json(),
    }


def _tp_to_json(block: Block) -> dict[str, Any]:
    """A block's tensor-parallel figures under "tp"; left out when it has none, so older files keep their bytes."""
    tp = block.tp
    if tp is None:
        return {}
    sequence: dict[str, Any] = {"sequence_time_share": tp.sequence_time_share, "sequence_saved_share": tp.sequence_saved_share} \
        if tp.sequence_time_share or tp.sequence_saved_share else {}  # older files keep their bytes
    if tp.regather_bytes != ZERO:
        sequence["regather_bytes"] = tp.regather_bytes.to_json()
    return {"tp": {"time_share": tp.time_share, "param_bytes": tp.param_bytes, "saved_share": tp.saved_share,
                   "comm_bytes": tp.comm_bytes.to_json(), "divisor": tp.divisor, **sequence}}


def _attention_core_to_json(block: Block) -> dict[str, Any]:
    """A block's attention core figures; left out without a core, so older files keep their bytes."""
    if block.attention_core_bytes == ZERO and block.attention_core_s == ZERO:
        return {}
    return {"attention_core_bytes": block.attention_core_bytes.to_json(),
            "attention_core_s": block.attention_core_s.to_json()}


def _tp_from_json(item: Any, where: str) -> BlockTensorParallel | None:
    if "tp" not in item:
        return None
    data, at = item["tp"], f"{where}.tp"
    return BlockTensorParallel(time_share=read_field(data, "time_share", float, at),
                               param_bytes=read_field(data, "param_bytes", int, at),
                               saved_share=read_field(data, "saved_share", float, at),
                               comm_bytes=Affine.from_json(data["comm_bytes"]),
                               divisor=read_field(data, "divisor", int, at),
                               sequence_time_share=read_field(data, "sequence_time_share", float, at)
                               if "sequence_time_share" in data else 0.0,
                               sequence_saved_share=read_field(data, "sequence_saved_share", float, at)
                               if "sequence_saved_share" in data else 0.0,
                               regather_bytes=Affine.from_json(data["regather_bytes"]) if "regather_bytes" in data
                               else ZERO)


def _shared_from_json(item: Any, where: str) -> SharedParam:
    return SharedParam(name=read_field(item, "name", str, where), num_bytes=read_field(item, "num_bytes", int, where),
                       blocks=read_field(item, "blocks", tuple[int, ...], where))


def _block_from_json(item: Any, where: str) -> Block:
    return Block(
        name=read_field(item, "name", str, where),
        node_names=read_field(item, "node_names", tuple[str, ...], where),
        forward_s=Affine.from_json(item["forward_s"]),
        backward_s=Affine.from_json(item["backward_s"]),
        param_bytes=read_field(item, "param_bytes", int, where),
        saved_bytes=Affine.from_json(item["saved_bytes"]),
        resaved=tuple((saver, Affine(*num_bytes)) for saver, num_bytes in (
            read_field(item, "resaved", tuple[tuple[int, tuple[float, float]], ...], where) if "resaved" in item else ())),
        tp=_tp_from_json(item, where),
        units=read_field(item, "units", tuple[tuple[str, int], ...], where) if "units" in item else (),
        attention_core_bytes=Affine.from_json(item["attention_core_bytes"]) if "attention_core_bytes" in item else ZERO,
        attention_core_s=Affine.from_json(item["attention_core_s"]) if "attention_core_s" in item else ZERO,
    )


def chain_from_json(data: Any) -> CostChain:
    """The cost chain of a plan file (:func:`chain_to_json`); PlanError names what is malformed."""
    try:
        return CostChain(
            blocks=tuple(_block_from_json(item, f"cost_chain.blocks[{i}]") for i, item in enumerate(data["blocks"])),
            cut_bytes=tuple(Affine.from_json(cut) for cut in data["cut_bytes"]),
            input_bytes=Affine.from_json(data["input_bytes"]),
            output_bytes=Affine.from_json(data["output_bytes"]),
            source=read_field(data, "source", str, "cost_chain") if "source" in data else "",
            shared_params=tuple(_shared_from_json(item, f"cost_chain.shared_params[{i}]")
                                for i, item in enumerate(data.get("shared_params", []))),
            loss_saved_bytes=Affine.from_json(data.get("loss_saved_bytes", [0.0, 0.0])),
            input_saved_bytes=Affine.from_json(data.get("input_saved_bytes", [0.0, 0.0])),
            target_saved_bytes=Affine.from_json(data.get("target_saved_bytes", [0.0, 0.0])),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise PlanError(f"plan file's 'cost_chain' is malformed: {error!r}") from error


def save_plan_file(path: str | Path, plan: Plan, chain: CostChain, cluster: Cluster,
                   run: Mapping[str, Any] | None = None) -> None:
    """Write ``plan`` with its chain and cluster as deterministic JSON.

    ``run``: facts of the run that made the plan (planning time, host, versions), written as the
    top-level ``"run"`` object; two runs of the same command differ only inside it. Reading ignores it.
    """
    data = plan.to_json_dict()
    data["cost_chain"] = chain_to_json(chain)
    data["cluster_spec"] = cluster.to_json()
    if run is not None:
        data["run"] = dict(run)
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def load_plan_file(path: str | Path) -> tuple[Plan, CostChain | None, Cluster | None]:
    """Read a plan file; the chain and cluster are None when the file holds only a plan."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise PlanError(f"cannot read plan file {str(path)!r}: {error}") from error
    except (ValueError, RecursionError) as error:  # JSONDecodeError, an int of too many digits, deep nesting
        raise PlanError(f"plan file {str(path)!r} is not JSON: {error}") from error
    plan = plan_from_dict(data)
    chain = chain_from_json(data["cost_chain"]) if "cost_chain" in data else None
    cluster = Cluster.from_json(data["cluster_spec"]) if "cluster_spec" in data else None
    return plan, chain, cluster
