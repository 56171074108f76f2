"""oscars-launch's attempts at one job, and what it says when they end.

`run` starts the job and starts it again after a failure, as --restarts
and --lost_peer_restarts allow (launch.py has set up the network, the
CPU limits and the signals that every attempt shares); `exit_code` reports
how the last attempt ended. Both read the launcher's flags
(`launch.define_flags`). Imports no TensorFlow.
"""

import sys
import time

from oscars_tf.tools import emulation
from oscars_tf.tools.worker_processes import Job
from oscars_tf.tools.worker_processes import describe_exit


def run(command, env, coordinator, deadline, signals, limits, spaces,
        flag_values):
  """Starts the job, and again after a failure as --restarts and
  --lost_peer_restarts allow (`flag_values`: the launcher's flags). A job
  on several nodes runs node_attempts.run instead.

  Returns (the last attempt's Job, its exit codes, what ended it: the task
  that failed, "timeout", or None when it finished).
  """
  fv = flag_values
  restarts = lost_peer_restarts = 0
  lost_peer_budget = fv.lost_peer_restarts
  while True:
    # A new job, on new ports: the old ones may still be in TIME_WAIT.
    attempt = restarts + lost_peer_restarts
    job = Job(command, fv.num_workers, fv.host,
              env=dict(env, OSCARS_LAUNCH_ATTEMPT=str(attempt)),
              num_ps=fv.num_ps, coordinator_command=coordinator,
              **emulation.job_arguments(
                  fv.num_workers, fv.num_ps, spaces, limits))
    left = (None if deadline is None else
            max(deadline - time.monotonic(), 0.01))
    codes, failed = job.wait(left, fv.grace_seconds,
                             keep_going=fv.keep_going, interrupt=signals)
    if signals.received or failed in (None, "timeout"):
      return job, codes, failed
    if (fv.keep_going and job.lost_a_peer(failed) and
        lost_peer_restarts < lost_peer_budget):
      lost_peer_restarts += 1
      dead = sorted(i for i, c in job.exited.items() if c < 0)
      print(f"oscars-launch: worker(s) {dead} killed by a signal while "
            f"the others averaged with them: their collectives failed "
            f"(exit code {codes[failed]}); restarting all "
            f"{fv.num_workers} workers from the newest saved state, if "
            f"they keep one (--checkpoint_dir) "
            f"(lost-peer restart {lost_peer_restarts} of "
            f"{fv.lost_peer_restarts}).", file=sys.stderr)
      continue
    if restarts == fv.restarts:
      return job, codes, failed
    restarts += 1
    print(f"oscars-launch: {job.name(failed)} "
          f"{describe_exit(codes[failed])}; stopped the others; "
          f"restarting all {fv.num_workers} workers (restart "
          f"{restarts} of {fv.restarts}).", file=sys.stderr)


def exit_code(job, codes, failed, signals, flag_values):
  """Says on stderr how the last attempt ended (its workers stopped by
  then); returns the launcher's exit code. Arguments: what `run` returned,
  the launcher's signals and flags."""
  fv = flag_values
  if signals.received:
    late = (f"; SIGKILL to worker(s) {job.killed}, still running "
            f"{fv.grace_seconds:g}s after it" if job.killed else "")
    print(f"oscars-launch: got {signals.received.name}; forwarded it to "
          f"every worker and stopped them all{late}.", file=sys.stderr)
    return 128 + signals.received
  if failed == "timeout":
    print(f"oscars-launch: job ran past --timeout={fv.timeout:g}s; stopped "
          "all workers.", file=sys.stderr)
    return 124
  if failed is not None:
    print(f"oscars-launch: {job.name(failed)} "
          f"{describe_exit(codes[failed])}; stopped the other workers.",
          file=sys.stderr)
    return 1
  if job.lost:
    print(f"oscars-launch: the job finished without worker(s) "
          f"{sorted(job.tasks[i][1] for i in job.lost)}, lost during "
          "training.", file=sys.stderr)
    return 0
  if fv.num_ps:
    print(f"oscars-launch: the chief finished; stopped the "
          f"{fv.num_workers} worker and {fv.num_ps} ps servers.",
          file=sys.stderr)
    return 0
  spread = job.exit_spread()
  apart = "" if spread is None else f" (their exits {spread:.2f} s apart)"
  print(f"oscars-launch: all {fv.num_workers} workers "
        f"finished{apart}.", file=sys.stderr)
  return 0
