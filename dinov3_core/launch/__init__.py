"""The one torchrun launcher: run a torch distributed job from the CLI, a Prefect task or plain Python without
losing its output, its errors or its processes.

Why not just ``subprocess.run(torchrun …)``:

* **Cancellation.** Prefect's process worker cancels a flow run with ``os.killpg`` (SIGTERM, then SIGKILL) on the
  flow run's process group. torchrun runs in a session of its own, so that signal never catches it half-way
  through starting its ranks (it would die leaving the ones already started): the launcher stops the job as a
  whole. Its start is inside the cleanup's ``try``; a SIGTERM/SIGINT left at its default action (a `wsidino`
  command) only notes itself while the job runs and is delivered again once the job is stopped. The ranks run in
  sessions of their own too (torchrun's ``SubprocessHandler`` uses ``start_new_session=True``), so they only die
  with torchrun because they
  call `dinov3_core.procutil.die_with_parent` (``PR_SET_PDEATHSIG``). torchrun gets the same protection from a tiny
  ``exec`` wrapper, so it stops its ranks when the launching process is killed without cleanup (SIGKILL to the
  group, the OOM killer, ``kill -9``).
* **Timeouts.** A sync Prefect task in a worker thread cannot be interrupted, and a blocking ``proc.wait()`` cannot
  be either: the job is polled, and on expiry it is stopped here (`TorchrunJob.timeout_s`).
* **No orphans.** Whatever ends the wait — success, failure, timeout, an exception in the calling thread such as
  Prefect's ``TerminationSignal`` or a failing log handler — every process of the job is stopped before
  `run_torchrun` returns or raises: torchrun gets SIGTERM (it forwards it), and after a grace period every
  remaining process is SIGKILLed. Processes are found as torchrun's descendants and, for those already orphaned,
  by a per-launch token in their environment.
* **Readable failures.** torchrun always exits 1 and prints its own traceback; the useful part is the failing
  rank's ``error.json`` (written by ``@record``) or, when there is none (exit code 2 for bad input, SIGKILL by the
  OOM killer), that rank's own stderr in the log directory. `TorchrunFailed` carries that root cause.

Only local rank 0's output is streamed (``--tee=3 --local-ranks-filter=0``); every rank's stdout/stderr stays in
``<log_dir>/<rdzv run id>_<random>/attempt_<n>/<local rank>/{stdout,stderr}.log`` (+ ``error.json``).

This module imports neither Prefect nor torch: pass ``get_run_logger().info`` as `log` inside a task. `log` is
always called from the calling thread (Prefect's run logger needs the run context, which is per thread).
"""

from dinov3_core.launch.job import DEFAULT_RDZV_ID, TorchrunFailed, TorchrunJob, torchrun_argv
from dinov3_core.launch.supervise import run_torchrun

__all__ = ["DEFAULT_RDZV_ID", "TorchrunFailed", "TorchrunJob", "run_torchrun", "torchrun_argv"]
