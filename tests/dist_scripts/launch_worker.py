"""A torchrun rank with a chosen behaviour (run by tests/test_launch.py through `dinov3_core.launch.run_torchrun`).

    python -m tests.dist_scripts.launch_worker MODE [PID_DIR]

Every rank first arms `die_with_parent` (as the stage entry points do), then, by MODE:

* ``ok``: gloo all-reduce of ones; prints ``rank-<r> says hello (sum=<world>)`` to stdout and ``rank-<r> on
  stderr`` to stderr; exits 0.
* ``raise``: rank 1 raises ``ValueError("boom-rank1")`` under ``@record``; rank 0 waits in a barrier (and fails
  there with gloo's "Connection closed by peer", as real peers do).
* ``exit2``: rank 1 prints ``error: bad input X`` to stderr and exits 2 without raising; rank 0 as above.
* ``sigkill``: rank 1 SIGKILLs itself (what the OOM killer does); rank 0 as above.
* ``hang``: starts a child process (stands for a DataLoader worker; it arms `die_with_parent` itself), writes
  ``PID_DIR/rank<r>.json`` = ``{"worker", "child", "torchrun"}`` pids, prints ``rank-<r> ready``, sleeps forever.
  It does not import torch, so its pids are on disk well within a second of the rank starting.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dinov3_core.procutil import die_with_parent

# The expected parent is passed explicitly: the rank may already be dead when the child gets to call prctl.
CHILD = (
    "import sys, time\n"
    "from dinov3_core.procutil import die_with_parent\n"
    "die_with_parent(expected_parent=int(sys.argv[1]))\n"
    "time.sleep(3600)\n"
)


def hang(pid_dir: Path) -> None:
    rank = int(os.environ["RANK"])
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(os.getpid())])
    record = {"worker": os.getpid(), "child": child.pid, "torchrun": os.getppid()}
    tmp = pid_dir / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.rename(pid_dir / f"rank{rank}.json")  # atomic: the test never reads a half-written file
    print(f"rank-{rank} ready", flush=True)
    while True:
        time.sleep(1)


def distributed(mode: str) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank-{rank} says hello (sum={int(total.item())})", flush=True)
    print(f"rank-{rank} on stderr", file=sys.stderr, flush=True)
    if mode == "exit2" and rank == 0:  # bad input is found per rank; rank 0 must not be the one left hanging
        dist.destroy_process_group()
        return 0
    if mode != "ok" and rank == 1:
        if mode == "raise":
            raise ValueError("boom-rank1")
        if mode == "exit2":
            print("error: bad input X", file=sys.stderr, flush=True)
            dist.destroy_process_group()  # like the stages' `finally: shutdown(env)`; gloo aborts at exit otherwise
            return 2
        if mode == "sigkill":
            os.kill(os.getpid(), 9)
    dist.barrier()
    dist.destroy_process_group()
    assert world == 2
    return 0


def main() -> int:
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        die_with_parent()
    mode = sys.argv[1]
    if mode == "hang":
        hang(Path(sys.argv[2]))
    # Imported here, not at the top: `hang` must not pay for importing torch.
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(distributed)(mode)


if __name__ == "__main__":
    sys.exit(main())
