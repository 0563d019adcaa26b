"""Start local ranks through torchrun's own launcher (torch.distributed.run), on loopback: CLI paths only."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence


def launch_local(num_processes: int, fxpipe_args: Sequence[str]) -> int:
    """Run ``python -m fxpipe <fxpipe_args>`` on ``num_processes`` local ranks under torchrun --standalone."""
    from torch.distributed.run import main as torchrun_main

    if num_processes < 1:
        raise ValueError(f"--nproc must be >= 1, got {num_processes}")
    argv = [
        "--standalone",
        f"--nproc-per-node={num_processes}",
        "--max-restarts=0",
        "--monitor-interval=1",
        "--no-python",
        sys.executable, "-m", "fxpipe", *fxpipe_args,
    ]
    try:
        torchrun_main(argv)
    except SystemExit as exit_request:
        return int(exit_request.code or 0)
    except Exception as error:  # torchrun raises ChildFailedError naming the failed rank
        print(f"fxpipe: a rank failed: {error}", file=sys.stderr)
        return 1
    return 0


def under_torchrun() -> bool:
    """Whether torchrun (or another launcher setting RANK/WORLD_SIZE) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def calibrate_command(num_processes: int) -> int:
    """``fxpipe calibrate``: measure the ``local`` cluster with real ranks and cache the figures.

    Outside torchrun it launches ``num_processes`` local ranks running this same command (the CLI is
    the launcher; library code never starts processes); under torchrun the ranks measure over their
    process group (:func:`fxpipe.runtime.calibration.calibrate.calibrate_group`, ``refresh``) and rank 0 prints
    the figures and writes the cache that ``local:N`` outside torchrun reads.
    """
    if not under_torchrun():
        if num_processes < 2:
            raise ValueError(f"--nproc must be >= 2 to measure a link between ranks; got {num_processes}")
        return launch_local(num_processes, ["calibrate"])  # (an --nproc here would be taken by torchrun)
    from fxpipe.runtime.calibration.calibrate import cache_path, calibrate, device_kind, local_device
    from fxpipe.runtime.transport.comm import close_distributed, init_distributed

    context = init_distributed()
    device = local_device(collective=True)
    result = calibrate(device, collective=True, refresh=True)
    if context.rank == 0:
        print(json.dumps({"cache": str(cache_path(device_kind(device))), "device": result.device,
                          "links": result.links, "source": result.source}, indent=2, sort_keys=True), flush=True)
    close_distributed(context)
    complete = result.device is not None and (result.links is not None or context.world_size == 1)
    return 0 if complete else 1
