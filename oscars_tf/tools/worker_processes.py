"""Local worker processes of one job: start, watch, stop (oscars-launch's
machinery; `Job` is also what the tests and benchmarks start jobs with).

Each worker gets its own TF_CONFIG on a free port, leads its own process
group (signals reach whatever it starts) and, on Linux, is killed by the
kernel if the thread that started it dies (PR_SET_PDEATHSIG). Its stdout and
stderr are forwarded line by line, prefixed with its index. With `num_ps`,
the job is ParameterServerStrategy's cluster instead: a chief (the
coordinator), the workers and the ps tasks, whose servers run until the
chief is done. Imports no TensorFlow.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from oscars_tf import exit_notes
from oscars_tf.errors import PEER_LOST_EXIT_CODE
from oscars_tf.errors import WorkerStartError
from oscars_tf.tools import job_guard
from oscars_tf.tools import process_groups
from oscars_tf.tools.job_layout import cluster_tasks
from oscars_tf.tools.job_layout import task_name
from oscars_tf.tools.job_layout import tf_configs

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Seconds a worker's exit 75 waits for the death that caused it to be seen.
PEER_DEATH_WINDOW_S = 3.0


def _prefix(kind, index):
  # Workers keep their bare index, so a worker-only job reads as before.
  return {"worker": f"[{index}] ", "chief": "[chief] ",
          "coordinator": "[coordinator] "}.get(kind, f"[{kind}{index}] ")


def _pump(stream, prefix, out):
  for line in iter(stream.readline, b""):
    # A worker killed mid-line: end its line, so the next one keeps its own.
    out.write(prefix + line.decode(errors="replace") +
              ("" if line.endswith(b"\n") else "\n"))
    out.flush()
  stream.close()


def compose(*steps):
  """One preexec_fn running `steps` (the Nones skipped) in order, or None."""
  steps = [s for s in steps if s is not None]
  if len(steps) <= 1:
    return steps[0] if steps else None

  def preexec():
    for step in steps:
      step()
  return preexec


class Signals:
  """Catches SIGTERM, SIGINT and SIGHUP while the launcher runs a job.

  The handler only records the signal: Job.wait sees it within one poll and
  forwards it to the workers. A signal ignored when the launcher starts
  (e.g. SIGHUP under nohup) stays ignored, as shells do.
  """

  def __init__(self):
    self.received = None  # the first signal, a signal.Signals
    self.count = 0
    self._previous = {}

  def __enter__(self):
    for sig in FORWARDED_SIGNALS:
      if signal.getsignal(sig) is not signal.SIG_IGN:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc_info):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _handle(self, signum, frame):
    del frame
    self.count += 1
    if self.received is None:
      self.received = signal.Signals(signum)


class Job:
  """A set of local worker processes started with their TF_CONFIGs.

  Each worker leads its own process group (signals reach whatever it
  starts) and, on Linux, is killed by the kernel if the thread that created
  the Job dies, and what it started with it, by the job's guard (see
  job_guard). With `num_ps`, the processes are a
  chief, the workers and the ps tasks (`tasks`, cluster_tasks' order); the
  workers' and ps tasks' servers never exit by themselves (`servers`), so
  the job is done when the chief is, and `wait` then stops them. Per-worker
  settings (`worker_env`) are keyed by worker index and go to the `worker`
  tasks only. With `coordinator_command`, one more process runs it as the
  cluster's `coordinator` task (last in `tasks`): a server too, stopped
  when the workers are done, and its failure ends the job. Indices into
  `procs` (failed, lost, killed, exited) are positions in `tasks`;
  `name(i)` says which task one is.
  `task_preexec` maps such a position to a step for that process to run
  after fork and before exec (e.g. join a cgroup,
  cpu_limits.CpuLimits.preexec; enter a network namespace,
  worker_netns.WorkerNamespaces.enter); it runs after the parent-death
  signal is set, and must take no lock.
  `spawn`: (command, env) -> a started process with Popen's `pid`,
  `stdout`, `stderr` (binary pipes), `poll` and `wait`, or None to start
  it with Popen as above; only for tasks without a `task_preexec` (the
  tests fork their workers from a server that imported TensorFlow once).
  `configs` (one TF_CONFIG per worker) and `first_worker` (the first one's
  global index): this node's workers in a job on several nodes
  (cli/multi_node.py); their cluster, ports included, is given, and the
  chief is here only where `first_worker` is 0.
  """

  def __init__(self, command, num_workers, host="127.0.0.1", env=None,
               worker_env=None, out=None, hosts=None, err=None, num_ps=0,
               task_preexec=None, coordinator_command=None, spawn=None,
               configs=None, first_worker=0):
    self.command = list(command)
    self.num_workers = num_workers
    coordinator = coordinator_command is not None
    self.tasks = cluster_tasks(num_workers, num_ps, coordinator,
                               first_worker)
    # The chief's position (a ps job's chief task, or worker 0), or None
    # on a node of a multi-node job without it.
    self.chief = 0 if self.tasks[0] in (("chief", 0), ("worker", 0)) else None
    self.servers = {i for i, (kind, _) in enumerate(self.tasks)
                    if (num_ps and kind != "chief") or kind == "coordinator"}
    self.procs = []
    self.lost = {}  # worker -> (exit code, seconds since start)
    self.killed = []  # workers that needed SIGKILL after the grace period
    self.exited = {}  # worker -> exit code, of those that ended by themselves
    # position -> time.time() when `wait` first saw the process gone (to
    # `poll` seconds): how far apart a job's workers ended.
    self.exit_times = {}
    self._threads = []
    # Where workers that exit 75 say which collective failed (exit_notes).
    self._notes = tempfile.mkdtemp(prefix="oscars-exit-notes-")
    # Two pipes, each pumped by whole lines: a log line on stderr is never
    # glued onto a progress bar's unfinished line on stdout. A capturing
    # `out` without `err` gets both.
    err = err or (out if out is not None else sys.stderr)
    out = out or sys.stdout
    die_with_parent = job_guard.die_with_parent()
    # What the tasks start outlives them unless their groups are killed:
    # by stop(), or by the guard if this process dies first.
    self._guard = job_guard.Guard()
    self._guard.remove_after(self._notes)
    configs = configs or tf_configs(num_workers, host, hosts=hosts,
                                    num_ps=num_ps, coordinator=coordinator)
    for position, ((kind, index), config) in enumerate(
        zip(self.tasks, configs)):
      penv = dict(os.environ if env is None else env)
      penv["TF_CONFIG"] = config
      penv[exit_notes.ENV] = self._notes
      if kind == "worker":
        penv.update((worker_env or {}).get(index, {}))
      preexec = compose(die_with_parent, (task_preexec or {}).get(position))
      # preexec_fn with the pump threads running is safe here: CPython runs
      # it in the forked child holding the GIL, and it takes no lock (prctl
      # is resolved before the fork; getppid, kill, setns and the cgroup
      # write are syscalls).
      command = (list(coordinator_command) if kind == "coordinator" else
                 self.command)
      p = None
      if spawn is not None and position not in (task_preexec or {}):
        p = spawn(command, penv)
      try:
        p = p or subprocess.Popen(
            command, env=penv, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=preexec)  # noqa: PLW1509
      except OSError as e:  # not found, not executable: nothing can run
        self.stop(grace=0)  # the tasks already started
        raise WorkerStartError(
            f"cannot start {task_name(kind, index)}'s command "
            f"{command[0]!r}: {e.strerror or e}.") from e
      self._guard_group(p.pid)
      for stream, sink in ((p.stdout, out), (p.stderr, err)):
        t = threading.Thread(target=_pump,
                             args=(stream, _prefix(kind, index), sink),
                             daemon=True)
        t.start()
        self._threads.append(t)
      self.procs.append(p)

  def _guard_group(self, pid):
    try:
      if os.getpgid(pid) == pid:  # its own group (start_new_session)
        self._guard.watch(pid)
    except ProcessLookupError:
      pass  # gone already

  def exit_spread(self):
    """Seconds from the first to the last worker's exit as `wait` saw them
    (to its `poll`), or None before two have exited."""
    times = [t for i, t in self.exit_times.items() if i not in self.servers]
    return max(times) - min(times) if len(times) > 1 else None

  def name(self, i):
    """How messages name process `i`: "worker 3", "chief", "ps 0"."""
    return task_name(*self.tasks[i])

  def wait(self, timeout=None, grace=10.0, poll=0.05, keep_going=False,
           interrupt=None, after_chief=60.0):
    """Waits for all workers; returns (exit codes, failed index or None).

    The first worker to exit non-zero ends the job: the others get SIGTERM,
    then SIGKILL after `grace` seconds. With `keep_going`, a worker other
    than the chief that is killed by a signal (SIGKILL, an OOM kill, a
    crash) is *lost* instead: the others drop it at their next round end and
    go on (see `lost`); so is one that exits with PEER_LOST_EXIT_CODE (a
    lost peer, e.g. its link was cut) unless it was in a collective with a
    worker killed by a signal (its exit note says whom the collective met:
    exit_notes.py): it then ends the job, to be restarted from the
    survivors' round states (see `lost_a_peer`). Any other error code
    ends the job (a bug or a bad input every worker may share).
    In a ParameterServerStrategy job (`servers`), the job is done when the
    chief exits 0: the servers still running then get SIGTERM, SIGKILL
    after `grace` (listed in `killed`); only worker tasks can be lost. A
    worker running `after_chief` s after the chief finished (stopped, or
    dropped and hung) gets SIGKILL: lost with `keep_going`, else failed.
    Past `timeout` seconds, failed is "timeout". Once `interrupt` (a
    Signals) has received a signal, every worker gets it, then SIGKILL
    after `grace`, and failed is "signal" (a further one cuts it short).
    """
    deadline = None if not timeout else time.monotonic() + timeout
    failed = None
    t0 = time.monotonic()
    while True:
      if interrupt is not None and interrupt.received:
        failed = "signal"
        break
      codes = [p.poll() for p in self.procs]
      now = time.time()
      for i, c in enumerate(codes):
        if c is not None:
          self.exit_times.setdefault(i, now)
      if keep_going and self._death_may_follow(codes, now):
        time.sleep(poll)
        continue
      for i, c in sorted(enumerate(codes), key=lambda ic: (ic[1] or 0) >= 0):
        # Deaths first: a survivor of the dead worker's collective (75)
        # then ends the job, to be restarted with the chief (lost_a_peer),
        # whether or not the chief was in that collective.
        if (keep_going and i != self.chief and
            self.tasks[i][0] == "worker" and c is not None and
            i not in self.lost and
            (c < 0 or (c == PEER_LOST_EXIT_CODE and
                       not self._survivor_of_a_death(i)))):
          self.lost[i] = (c, time.monotonic() - t0)
          print(f"oscars-launch: {self.name(i)} {describe_exit(c)}; the "
                "others go on without it.", file=sys.stderr)
      bad = [i for i, c in enumerate(codes)
             if c not in (None, 0) and i not in self.lost]
      if bad:
        # A 75 is a consequence (a lost peer or service): a cause seen in
        # the same poll, e.g. the coordinator task's death, is named first.
        failed = min(bad, key=lambda i: codes[i] == PEER_LOST_EXIT_CODE)
        break
      if all(c == 0 or i in self.lost or i in self.servers
             for i, c in enumerate(codes)):
        break
      if self.tasks[0] == ("worker", 0) and codes[0] == 0:
        killed = self._kill_left_behind(codes, after_chief, t0, keep_going)
        if killed and not keep_going:  # any death ends the job
          failed = killed[0]
          break
      if deadline and time.monotonic() > deadline:
        failed = "timeout"
        break
      time.sleep(poll)
    self.exited = {i: c for i, c in enumerate(codes) if c is not None}
    if failed is None and (self.servers or
                           any(process_groups.alive(p) for p in self.procs)):
      # The chief is done: so are the servers, and anything an exited
      # worker left running in its group.
      self.stop(grace)
    elif failed is not None:
      seen = interrupt.count if interrupt is not None else 0
      self.stop(grace, interrupt.received if failed == "signal" else
                signal.SIGTERM,
                hurry=lambda: interrupt is not None and interrupt.count > seen)
    for t in self._threads:
      t.join(timeout=5)
    if all(p.poll() is not None for p in self.procs):
      self._done()
    return [p.poll() for p in self.procs], failed

  def _kill_left_behind(self, codes, after_chief, t0, lose=True):
    """Kills the workers still running `after_chief` s after the chief
    exited 0 (dropped: it waits for its members), lost if `lose`."""
    if time.time() - self.exit_times[0] < after_chief:
      return []
    killed = []
    for i, c in enumerate(codes):
      if c is None and self.tasks[i][0] == "worker" and i not in self.lost:
        process_groups.signal_group(self.procs[i], signal.SIGKILL)
        killed.append(i)
        code = self.procs[i].wait()
        if lose:
          self.lost[i] = (code, time.monotonic() - t0)
        print(f"oscars-launch: {self.name(i)} still ran {after_chief:g} s "
              "after the chief finished (stalled, or dropped and never "
              "back); killed it.", file=sys.stderr)
    return killed

  def _death_may_follow(self, codes, now):
    """Whether a worker's fresh exit 75 is not yet explained by a death
    while others still run: the survivor of a collective may exit before
    the launcher sees its dead peer's exit (through a wrapper process, or
    on a loaded machine), and is classified once the death is seen, or
    after PEER_DEATH_WINDOW_S as a 75 of its own."""
    return None in codes and any(
        c == PEER_LOST_EXIT_CODE and i not in self.lost and
        now - self.exit_times[i] < PEER_DEATH_WINDOW_S and
        not self._survivor_of_a_death(i, codes)
        for i, c in enumerate(codes))

  def _survivor_of_a_death(self, i, codes=None):
    """Whether task `i`'s exit 75 came from a collective with a worker
    killed by a signal (its note names the collective's members; without
    a note, assumed so). A 75 of its own, after a death the others
    dropped cleanly, is a lone loss."""
    dead = {self.tasks[j][1] for j, (c, _) in self.lost.items() if c < 0}
    dead |= {self.tasks[j][1] for j, c in enumerate(codes or [])
             if c is not None and c < 0 and self.tasks[j][0] == "worker"}
    if not dead:
      return False
    peers = exit_notes.read(self._notes, self.tasks[i][1])
    return peers is None or bool(dead.intersection(peers))

  def lost_a_peer(self, failed):
    """Whether the job ended only because a peer was lost inside a
    collective: a worker was killed by a signal, and `failed` (the chief, or
    another member of that collective) and any other that exited did so
    with PEER_LOST_EXIT_CODE, their collectives aborted by that death (see
    docs/reliability.md)."""
    codes = self.exited
    # Only a worker's death is a lost peer: the coordinator task's (or
    # another server's) ends the job, even when the workers' 75s, which
    # it caused, are seen in the same poll.
    worker_death = {i: c < 0 and self.tasks[i][0] == "worker"
                    for i, c in codes.items()}
    return (isinstance(failed, int) and
            codes.get(failed) == PEER_LOST_EXIT_CODE and
            any(worker_death.values()) and
            all(c in (0, PEER_LOST_EXIT_CODE) or worker_death[i]
                for i, c in codes.items()))

  def stop(self, grace=10.0, sig=signal.SIGTERM, hurry=None):
    """Sends `sig` to every live worker's process group, then SIGKILL.

    SIGKILL goes to the workers still running after `grace` seconds, or as
    soon as `hurry()` is true. Returns their indices (also in `killed`).
    """
    for p in self.procs:
      process_groups.signal_group(p, sig)
    end = time.monotonic() + grace
    while (time.monotonic() < end and not (hurry and hurry()) and
           any(process_groups.alive(p) for p in self.procs)):
      time.sleep(0.05)
    late = [i for i, p in enumerate(self.procs) if p.poll() is None]
    for p in self.procs:
      process_groups.signal_group(p, signal.SIGKILL)
      p.wait()
    self.killed = sorted(set(self.killed) | set(late))
    self._done()
    return late

  def _done(self):
    """Every task has ended: the guard and the notes go."""
    self._guard.done()
    shutil.rmtree(self._notes, ignore_errors=True)


def describe_exit(code):
  if code == PEER_LOST_EXIT_CODE:
    return f"exited with code {code} (it lost a peer, or the job)"
  if code is not None and code < 0:
    try:
      return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"was killed by signal {-code}"
  return f"exited with code {code}"
