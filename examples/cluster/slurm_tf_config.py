"""Prints TF_CONFIG for this srun task: one worker per node of the step.

The fallback for node names that TensorFlow's SlurmClusterResolver orders
differently from Slurm (it sorts them as strings: node10 before node9).
Workers are the step's nodes in Slurm's own order (`scontrol show
hostnames`), each at PORT; this task's index is its node's position. Run it
under srun with one task per node:

    srun --ntasks-per-node=1 bash -c 'TF_CONFIG="$(python \
        examples/cluster/slurm_tf_config.py --port 8888)" exec python \
        examples/train.py --strategy=oscars --cluster_resolver=tf_config ...'
"""

import argparse
import json
import os
import subprocess
import sys


def tf_config(port, environ=None):
  """TF_CONFIG (a JSON string) for the srun task described by `environ`."""
  environ = os.environ if environ is None else environ
  try:
    nodelist = environ["SLURM_STEP_NODELIST"]
    node = environ["SLURMD_NODENAME"]
    num_tasks = int(environ["SLURM_STEP_NUM_TASKS"])
  except KeyError as e:
    sys.exit(f"slurm_tf_config: {e.args[0]} is not set; run this under srun.")
  hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist],
                         check=True, capture_output=True, text=True).stdout
  hosts = hosts.split()
  if num_tasks != len(hosts) or node not in hosts:
    sys.exit(f"slurm_tf_config: needs one task per node; the step has "
             f"{num_tasks} task(s) on {len(hosts)} node(s) {hosts}, this one "
             f"on {node}.")
  return json.dumps({"cluster": {"worker": [f"{h}:{port}" for h in hosts]},
                     "task": {"type": "worker", "index": hosts.index(node)}})


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--port", type=int, default=8888,
                      help="the workers' port on every node (default 8888)")
  print(tf_config(parser.parse_args().port))


if __name__ == "__main__":
  main()
