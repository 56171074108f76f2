"""python -m oscars_tf.cli.coordinator: the task that hosts a job's
coordination service, so that the chief's process does not.

A cluster may have a `coordinator` job of one task beside its `chief` and
`worker` jobs (oscars-launch --coordinator makes one):

    TF_CONFIG='{"cluster": {"worker": ["h0:2222", "h1:2222"],
                            "coordinator": ["h2:2222"]},
                "task": {"type": "coordinator", "index": 0}}' \\
        python -m oscars_tf.cli.coordinator

That task then hosts TensorFlow's coordination service (the key-value store
the rounds' rows and decisions go through, and every task's heartbeats),
which otherwise runs in the chief's process: every worker's post and read
is an RPC its process serves, beside the chief's own round (at 1,024
workers, 8 a host, tens of milliseconds of CPU a round on a small machine;
benchmarks/README.md). The chief still decides each round's members.

It trains nothing, and runs until the chief's process is gone (the chief
exits last: it waits for every worker to say it is done), or until SIGTERM
or SIGINT. Exit code 0 then; 1 if the chief never came up within
--register_timeout. Its death ends the job, as the chief's does.
"""

import os
import signal
import socket
import sys
import threading
import time

from absl import app
from absl import flags
from absl import logging

from oscars_tf import cluster
from oscars_tf.errors import ClusterConfigError
from oscars_tf.tools import command_help

flags.DEFINE_float("heartbeat_timeout", 600.0, "Seconds without a task's "
                   "heartbeat before the service takes it for dead; the "
                   "service's setting is the one that counts. Twice the "
                   "strategy's collective_timeout (OscarsStrategy sets that "
                   "on the chief when the chief hosts the service).",
                   lower_bound=1.0)
flags.DEFINE_float("register_timeout", 120.0, "Seconds for every task to "
                   "join the cluster.", lower_bound=1.0)
flags.DEFINE_float("poll", 0.5, "Seconds between checks that the chief's "
                   "process is still there.", lower_bound=0.01)
FLAGS = flags.FLAGS

USAGE = ("python -m oscars_tf.cli.coordinator [flags]  (TF_CONFIG: the "
         "cluster's coordinator task)")
DESCRIPTION = (
    "Hosts a job's coordination service as the cluster's `coordinator` "
    "task\n(TF_CONFIG), instead of the chief; runs until the chief's "
    "process is gone.")
SECTIONS = (("coordination service", ("heartbeat_timeout", "register_timeout",
                                      "poll")),)


def chief_gone(address):
  """Whether the chief's process is gone: nothing listens at its address,
  or (a pod that was deleted) its name no longer resolves."""
  host, _, port = address.rpartition(":")
  try:
    socket.getaddrinfo(host.strip("[]"), int(port))
  except socket.gaierror:
    return True
  return cluster.connection_refused(address)


def wait_for_chief(address, register_timeout_s, poll_s, stop,
                   is_gone=chief_gone):
  """Blocks while the chief at `address` runs. True once it has come up
  and gone, or `stop` (a threading.Event) is set; False if it never came
  up within `register_timeout_s`."""
  deadline = time.monotonic() + register_timeout_s
  seen = False
  while not stop.is_set():
    if not is_gone(address):
      seen = True
    elif seen:
      return True
    elif time.monotonic() > deadline:
      return False
    stop.wait(poll_s)
  return True


def serve(info, register_timeout_s, heartbeat_timeout_s, poll_s):
  """Hosts the service for `info`'s cluster until the chief is gone."""
  if not info.is_coordinator:
    raise ClusterConfigError(
        f"this task is {info.task_type}:{info.task_id}; the coordinator "
        f"runs as the cluster's '{cluster.COORDINATOR_JOB}' task (TF_CONFIG's "
        "task type; oscars-launch --coordinator adds one).")
  from oscars_tf.runtime import server  # pylint: disable=g-import-not-at-top
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  server.start(info, heartbeat_timeout_s=heartbeat_timeout_s,
               register_timeout_s=register_timeout_s)  # keeps our SIGTERM
  chief = info.workers[0][2]
  logging.info("oscars_tf: coordination service of %d workers up at %s; "
               "serving until the chief (%s) is gone", info.num_workers,
               info.address, chief)
  if not wait_for_chief(chief, register_timeout_s, poll_s, stop):
    logging.error("oscars_tf: the chief at %s never came up within %gs.",
                  chief, register_timeout_s)
    return 1
  logging.info("oscars_tf: %s; the coordination service stops.",
               "stopped by a signal" if stop.is_set() else "the chief is gone")
  return 0


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    info = cluster.from_tf_config()
    code = serve(info, FLAGS.register_timeout, FLAGS.heartbeat_timeout,
                 FLAGS.poll)
  except ClusterConfigError as e:
    print(f"oscars_tf.cli.coordinator: error: {e}", file=sys.stderr)
    return 1
  sys.stdout.flush()
  sys.stderr.flush()
  # Nothing to save, and TensorFlow's teardown of the service could wait
  # on tasks that are gone.
  os._exit(code)  # pylint: disable=protected-access


def help_text():
  return command_help.help_text(USAGE, DESCRIPTION, SECTIONS, FLAGS)


if __name__ == "__main__":
  app.run(main, flags_parser=command_help.flags_parser(help_text))
