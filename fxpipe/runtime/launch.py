"""Start local ranks through torchrun's own launcher (torch.distributed.run), on loopback."""

from __future__ import annotations

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
