"""A local job's layout: its tasks, their ports and TF_CONFIGs, their names."""

import errno
import json
import random
import socket


def _ephemeral_range():
  """The kernel's range for ports bound to 0 and outgoing connections."""
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range",
              encoding="ascii") as f:
      low, high = (int(x) for x in f.read().split())
    return low, high
  except (OSError, ValueError):
    return 32768, 60999


def free_ports(n, host="127.0.0.1"):
  """n distinct free TCP ports on host (bound once, then released).

  Drawn below the kernel's ephemeral range where it leaves room: a port
  the kernel handed out (to a port-0 bind, or to any outgoing connection
  of another job on the machine) could be taken again between this check
  and the task's own bind; one below the range is only taken by a
  process that asks for it by number.
  """
  low, _ = _ephemeral_range()
  candidates = list(range(10000, low)) if low > 12000 else []
  random.SystemRandom().shuffle(candidates)
  sockets, ports = [], []
  try:
    while len(ports) < n:
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      port = candidates.pop() if candidates else 0
      try:
        s.bind((host, port))
      except OSError as e:
        s.close()
        if port == 0 or e.errno not in (errno.EADDRINUSE, errno.EACCES):
          raise  # not this port: the host itself
        continue
      sockets.append(s)
      ports.append(s.getsockname()[1])
  finally:
    for s in sockets:
      s.close()
  return ports


def cluster_tasks(num_workers, num_ps=0, coordinator=False, first_worker=0):
  """(task type, index) of each process of a job, in a Job's order.

  Without ps tasks: the workers, worker 0 the chief (OscarsStrategy,
  MultiWorkerMirroredStrategy), and with `coordinator` last the task that
  hosts the coordination service (oscars_tf/cli/coordinator.py). With ps
  tasks: ParameterServerStrategy's cluster, the chief (the coordinator)
  first, then the workers, then the ps. `first_worker`: the index of the
  first worker, where this node's workers are part of a job on several
  nodes (workers only).
  """
  if not num_ps:
    return ([("worker", first_worker + i) for i in range(num_workers)] +
            [("coordinator", 0)] * bool(coordinator))
  return ([("chief", 0)] + [("worker", i) for i in range(num_workers)] +
          [("ps", i) for i in range(num_ps)])


def tf_configs(num_workers, host="127.0.0.1", ports=None, hosts=None,
               num_ps=0, coordinator=False):
  """One TF_CONFIG JSON string per task of a local cluster (cluster_tasks'
  order): per worker (and the coordinator task), or with `num_ps` a chief,
  workers and ps tasks.

  `hosts` (one address per task) places tasks on different addresses,
  e.g. 127.0.0.1 and 127.0.0.2 to stand for two hosts on loopback.
  """
  tasks = cluster_tasks(num_workers, num_ps, coordinator)
  ports = ports or free_ports(len(tasks), host)
  hosts = hosts or [host] * len(tasks)
  cluster = {}
  for (kind, _), h, p in zip(tasks, hosts, ports):
    cluster.setdefault(kind, []).append(f"{h}:{p}")
  return [json.dumps({"cluster": cluster,
                      "task": {"type": kind, "index": i}})
          for kind, i in tasks]


def task_name(kind, index):
  """How messages name a task: "worker 3", "chief", "ps 0"."""
  return kind if kind in ("chief", "coordinator") else f"{kind} {index}"
