"""Tests for the multi-host recipes in examples/cluster/.

TF_CONFIG as the Kubeflow training operator sets it and the Slurm variables
as srun sets them, resolved by oscars_tf.cluster and by TensorFlow's cluster
resolvers; and the committed recipe files, checked against each other. No
server is started: multi-worker clusters are only resolved, and the strategy
itself is built for one-worker clusters (which start none).
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import tensorflow as tf

import oscars_tf
from oscars_tf import cluster
from oscars_tf.errors import ClusterConfigError
from oscars_tf.runtime import server

RECIPES = pathlib.Path(__file__).resolve().parents[1] / "examples" / "cluster"
RESOLVER_KINDS = ("tf_config", "slurm")  # examples/train.py --cluster_resolver

TFConfigClusterResolver = tf.distribute.cluster_resolver.TFConfigClusterResolver
SlurmClusterResolver = tf.distribute.cluster_resolver.SlurmClusterResolver


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
  """No TF_CONFIG or SLURM_* variable of the machine running the tests."""
  for name in list(os.environ):
    if name == "TF_CONFIG" or name.startswith(("SLURM_", "SLURMD_")):
      monkeypatch.delenv(name)


@pytest.fixture
def fresh_runtime(monkeypatch):
  """Lets this test's strategy join its own one-worker cluster."""
  monkeypatch.setattr(server, "_started", None)


# --- TF_CONFIG ---------------------------------------------------------------


def kubeflow_tf_config(name, namespace, replicas, task_type, index,
                       port=2222):
  """TF_CONFIG as the Kubeflow training operator writes it for one pod.

  As genTFConfigJSONStr / genClusterSpec (pkg/controller.v1/tensorflow) do:
  job names are the replica types lowercased, addresses are the per-replica
  headless services `<job>-<type>-<index>.<namespace>.svc:<port>`.
  """
  spec = {rtype.lower(): [f"{name}-{rtype.lower()}-{i}.{namespace}.svc:{port}"
                          for i in range(n)]
          for rtype, n in replicas.items()}
  return json.dumps({"cluster": spec,
                     "task": {"type": task_type.lower(), "index": index},
                     "environment": "cloud"})


def both_paths(monkeypatch, text):
  """(from_tf_config(), from_resolver(TFConfigClusterResolver())) of text."""
  monkeypatch.setenv("TF_CONFIG", text)
  return (cluster.from_tf_config(),
          cluster.from_resolver(TFConfigClusterResolver()))


@pytest.mark.parametrize("replicas, task_type, index, worker_index", [
    ({"Worker": 3}, "Worker", 0, 0),
    ({"Worker": 3}, "Worker", 1, 1),
    ({"Worker": 3}, "Worker", 2, 2),
    ({"Chief": 1, "Worker": 2}, "Chief", 0, 0),
    ({"Chief": 1, "Worker": 2}, "Worker", 0, 1),
    ({"Chief": 1, "Worker": 2}, "Worker", 1, 2),
])
def test_kubeflow_tf_config_resolves_the_same_both_ways(
    monkeypatch, replicas, task_type, index, worker_index):
  text = kubeflow_tf_config("mnist", "team-a", replicas, task_type, index)
  info, via_resolver = both_paths(monkeypatch, text)
  assert info == via_resolver
  assert info.num_workers == sum(replicas.values())
  assert (info.task_type, info.task_id) == (task_type.lower(), index)
  assert info.worker_index == worker_index
  assert info.is_chief == (worker_index == 0)
  assert info.address == (
      f"mnist-{task_type.lower()}-{index}.team-a.svc:2222")
  first = "chief" if "Chief" in replicas else "worker"
  assert info.workers[0] == (first, 0, f"mnist-{first}-0.team-a.svc:2222")


@pytest.mark.parametrize("other", ["PS", "Master", "Evaluator"])
def test_kubeflow_replica_types_other_than_chief_and_worker_are_refused(
    monkeypatch, other):
  text = kubeflow_tf_config("mnist", "default", {"Worker": 2, other: 1},
                            "Worker", 0)
  monkeypatch.setenv("TF_CONFIG", text)
  with pytest.raises(ClusterConfigError, match="'chief' and 'worker'"):
    cluster.from_tf_config()
  with pytest.raises(ClusterConfigError, match="'chief' and 'worker'"):
    cluster.from_resolver(TFConfigClusterResolver())


def test_tf_config_files_describe_one_cluster_and_differ_in_task_index(
    monkeypatch):
  paths = sorted(RECIPES.glob("tf_config_host*.json"))
  assert [p.name for p in paths] == ["tf_config_host0.json",
                                     "tf_config_host1.json"]
  configs = [json.loads(p.read_text()) for p in paths]
  for i, config in enumerate(configs):
    assert config["task"] == {"type": "worker", "index": i}
    assert {k: v for k, v in config.items() if k != "task"} == {
        k: v for k, v in configs[0].items() if k != "task"}
  addresses = configs[0]["cluster"]["worker"]
  assert len({a.rpartition(":")[0] for a in addresses}) == len(paths)
  for i, path in enumerate(paths):
    info, via_resolver = both_paths(monkeypatch, path.read_text())
    assert info == via_resolver
    assert (info.num_workers, info.worker_index) == (len(paths), i)
    assert info.address == addresses[i] and info.is_chief == (i == 0)


# --- The Kubeflow manifest ---------------------------------------------------


def _strip_comments(text):
  return re.sub(r"(?m)(^|[ \t]+)#.*$|[ \t]+$", "", text)


def _manifest_facts_yaml(text):
  import yaml  # pylint: disable=g-import-not-at-top
  job, policy = list(yaml.safe_load_all(text))
  specs = job["spec"]["tfReplicaSpecs"]
  (container,) = [c for spec in specs.values()
                  for c in spec["template"]["spec"]["containers"]
                  if c["name"] == "tensorflow"]
  return {
      "api_version": job["apiVersion"], "kind": job["kind"],
      "name": job["metadata"]["name"],
      "namespace": job["metadata"]["namespace"],
      "replicas": {k: v["replicas"] for k, v in specs.items()},
      "dynamic": job["spec"].get("enableDynamicWorker", False),
      "container": container["name"],
      "ports": {p["name"]: p["containerPort"] for p in container["ports"]},
      "command": container["command"],
      "pod_labels": [spec["template"]["metadata"]["labels"]
                     for spec in specs.values()],
      "policy_kind": policy["kind"],
      "policy_selector": policy["spec"]["podSelector"]["matchLabels"],
      "policy_from": [f["podSelector"]["matchLabels"]
                      for rule in policy["spec"]["ingress"]
                      for f in rule["from"]],
      "policy_ports": [p["port"] for rule in policy["spec"]["ingress"]
                       for p in rule["ports"]],
  }


def _labels(block):
  return dict(re.findall(r"^\s+(\S+):\s*(\S+)$", block, re.M))


def _manifest_facts_text(text):
  """The same facts without PyYAML (not a dependency), for this file only."""
  job, policy = _strip_comments(text).split("\n---\n")

  def one(pattern, doc=job):
    return re.search(pattern, doc, re.M).group(1)

  command = one(r"^\s+command:\n((?:\s+- .*\n)+)")
  return {
      "api_version": one(r"^apiVersion:\s*(\S+)"),
      "kind": one(r"^kind:\s*(\S+)"),
      "name": one(r"^metadata:\n\s+name:\s*(\S+)"),
      "namespace": one(r"^metadata:\n(?:\s+.*\n)*?\s+namespace:\s*(\S+)"),
      "replicas": {t: int(n) for _, t, n in re.findall(
          r"^(\s+)(\w+):\n\1  replicas:\s*(\d+)", job, re.M)},
      "dynamic": "enableDynamicWorker" in job,
      "container": one(r"^\s+- name:\s*(\S+)\n\s+image:"),
      "ports": {n: int(p) for n, p in re.findall(
          r"^\s+- name:\s*(\S+)\n\s+containerPort:\s*(\d+)", job, re.M)},
      "command": [line.strip()[2:] for line in command.splitlines()],
      "pod_labels": [_labels(b) for b in re.findall(
          r"^\s+template:\n\s+metadata:\n\s+labels:\n((?:\s+\S+: \S+\n)+)",
          job, re.M)],
      "policy_kind": one(r"^kind:\s*(\S+)", policy),
      "policy_selector": _labels(one(
          r"^spec:\n\s+podSelector:\n\s+matchLabels:\n((?:\s+\S+: \S+\n)+)",
          policy)),
      "policy_from": [_labels(b) for b in re.findall(
          r"^\s+- podSelector:\n\s+matchLabels:\n((?:\s+\S+: \S+\n)+)",
          policy, re.M)],
      "policy_ports": [int(p) for p in re.findall(r"^\s+port:\s*(\d+)",
                                                  policy, re.M)],
  }


def manifest_facts():
  text = (RECIPES / "tfjob.yaml").read_text()
  try:
    return _manifest_facts_yaml(text)
  except ImportError:
    return _manifest_facts_text(text)


def test_text_reading_of_the_manifest_matches_yaml():
  pytest.importorskip("yaml")
  text = (RECIPES / "tfjob.yaml").read_text()
  assert _manifest_facts_text(text) == _manifest_facts_yaml(text)


def test_tfjob_manifest_is_a_cluster_oscars_accepts():
  facts = manifest_facts()
  assert (facts["api_version"], facts["kind"]) == ("kubeflow.org/v1", "TFJob")
  # The operator lowercases replica types into job names; OscarsStrategy
  # trains with 'chief' and 'worker' jobs only, and needs the full cluster
  # ('sparseCluster' with enableDynamicWorker is not read).
  assert set(facts["replicas"]) <= {"Chief", "Worker"}
  assert facts["replicas"].get("Chief", 0) <= 1
  assert sum(facts["replicas"].values()) >= 2  # else no TF_CONFIG is set
  assert not facts["dynamic"]
  # TF_CONFIG goes to the container named "tensorflow" only; the operator's
  # port is the one named "tfjob-port" (default 2222).
  assert facts["container"] == "tensorflow"
  assert "tfjob-port" in facts["ports"]
  command = facts["command"]
  assert "examples/train.py" in command
  assert "--strategy=oscars" in command
  assert "--cluster_resolver=tf_config" in command


def test_tfjob_manifest_as_the_operator_would_configure_it(monkeypatch):
  facts = manifest_facts()
  replicas = facts["replicas"]
  total = sum(replicas.values())
  seen = set()
  for rtype in ("Chief", "Worker"):
    for index in range(replicas.get(rtype, 0)):
      text = kubeflow_tf_config(facts["name"], facts["namespace"], replicas,
                                rtype, index, facts["ports"]["tfjob-port"])
      info, via_resolver = both_paths(monkeypatch, text)
      assert info == via_resolver and info.num_workers == total
      seen.add(info.worker_index)
  assert seen == set(range(total))


def test_network_policy_admits_only_the_jobs_own_pods_on_its_port():
  facts = manifest_facts()
  assert facts["policy_kind"] == "NetworkPolicy"
  for labels in facts["pod_labels"]:
    assert facts["policy_selector"].items() <= labels.items()
  assert facts["policy_from"] == [facts["policy_selector"]]
  assert facts["policy_ports"] == [facts["ports"]["tfjob-port"]]


def test_recipes_name_each_other_and_the_resolver_kinds():
  texts = {p.name: p.read_text() for p in RECIPES.iterdir() if p.is_file()}
  used = {name: set(re.findall(r"--cluster_resolver=(\w+)", text))
          for name, text in texts.items()}
  assert set().union(*used.values()) <= set(RESOLVER_KINDS)
  assert used["slurm_train.sbatch"] == {"slurm"}
  assert used["tfjob.yaml"] == {"tf_config"}
  assert used["README.md"] == set(RESOLVER_KINDS)
  sbatch = texts["slurm_train.sbatch"]
  assert re.search(r"^srun .*\\\n\s+python examples/train.py", sbatch, re.M)
  for name in ("tf_config_host0.json", "tf_config_host1.json",
               "slurm_train.sbatch", "slurm_tf_config.py", "tfjob.yaml"):
    assert name in texts["README.md"]


def _train_py_commands():
  """Every train.py command line of the recipes, from train.py on."""
  readme = (RECIPES / "README.md").read_text()
  chunks = re.findall(r"```sh\n(.*?)```", readme, re.S)
  chunks.append((RECIPES / "slurm_train.sbatch").read_text())
  chunks.append(" ".join(manifest_facts()["command"]))
  return [c[c.index("examples/train.py"):] for c in chunks
          if "examples/train.py" in c]


def test_recipes_pass_only_flags_train_py_defines():
  root = RECIPES.parents[1]
  defined = set()
  for path in ("examples/train.py", "oscars_tf/cli/flags.py"):
    defined |= set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"",
                              (root / path).read_text()))
  commands = _train_py_commands()
  assert len(commands) >= 5  # 2 hosts, sbatch, its fallback, the TFJob
  for command in commands:
    used = set(re.findall(r"--(\w+)=", command))
    assert used and used <= defined, (used - defined, command)


# --- Slurm -------------------------------------------------------------------


@pytest.fixture
def no_tools(tmp_path, monkeypatch):
  """scontrol and nvidia-smi that fail and leave a mark, first on PATH."""
  bin_dir, mark = tmp_path / "bin", tmp_path / "called"
  bin_dir.mkdir()
  for tool in ("scontrol", "nvidia-smi", "sinfo", "squeue"):
    path = bin_dir / tool
    path.write_text(f"#!/bin/sh\necho {tool} \"$@\" >> '{mark}'\nexit 1\n")
    path.chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  yield
  assert not mark.exists(), f"the resolver ran {mark.read_text()!r}"


def srun_env(monkeypatch, nodelist, nodes, tasks_per_node, procid,
             node=None, local_id=None):
  """The environment srun gives task `procid` of a job step.

  The job (sbatch --nodes=len(nodes) --ntasks-per-node=k) and its step
  (srun) span `nodes` (Slurm's order; `nodelist` is the compressed form),
  with k tasks each, block distribution: task r runs on nodes[r // k] as
  local task r % k, unless `node` / `local_id` say otherwise.
  """
  k = tasks_per_node
  n = len(nodes) * k
  per_node = f"{k}(x{len(nodes)})" if len(nodes) > 1 else str(k)
  env = {
      "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242",
      "SLURM_JOB_NAME": "oscars-digits", "SLURM_CLUSTER_NAME": "hpc",
      "SLURM_SUBMIT_DIR": "/home/ada/oscars", "SLURM_SUBMIT_HOST": "login1",
      "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist,
      "SLURM_JOB_NUM_NODES": str(len(nodes)), "SLURM_NNODES": str(len(nodes)),
      "SLURM_NTASKS": str(n), "SLURM_NPROCS": str(n),
      "SLURM_NTASKS_PER_NODE": str(k), "SLURM_TASKS_PER_NODE": per_node,
      "SLURM_JOB_CPUS_PER_NODE": f"8(x{len(nodes)})",
      "SLURM_CPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "8",
      "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
      "SLURM_STEP_NODELIST": nodelist,
      "SLURM_STEP_NUM_NODES": str(len(nodes)),
      "SLURM_STEP_NUM_TASKS": str(n),
      "SLURM_STEP_TASKS_PER_NODE": per_node,
      "SLURM_DISTRIBUTION": "block",
      "SLURM_PROCID": str(procid),
      "SLURM_NODEID": str(procid // k),
      "SLURM_LOCALID": str(procid % k if local_id is None else local_id),
      "SLURMD_NODENAME": nodes[procid // k] if node is None else node,
      "SLURM_TOPOLOGY_ADDR": nodes[procid // k] if node is None else node,
  }
  for name, value in env.items():
    monkeypatch.setenv(name, value)


@pytest.mark.parametrize("procid", [0, 1])
def test_slurm_two_nodes_one_worker_each(monkeypatch, no_tools, procid):
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # a CPU node
  srun_env(monkeypatch, "node[01-02]", ["node01", "node02"], 1, procid)
  resolver = cluster.slurm_resolver(port_base=23456)
  assert isinstance(resolver, SlurmClusterResolver)
  info = cluster.from_resolver(resolver)
  assert info.jobs == {"worker": ("node01:23456", "node02:23456")}
  assert (info.task_type, info.task_id) == ("worker", procid)
  assert info.worker_index == procid and info.is_chief == (procid == 0)
  assert info.address == f"node0{procid + 1}:23456"
  assert info.rpc_layer == "grpc"
  assert "CUDA_VISIBLE_DEVICES" not in os.environ
  # What MultiWorkerMirroredStrategy reads: the GPUs this worker sees.
  assert resolver.num_accelerators() == {
      "GPU": len(tf.config.list_physical_devices("GPU"))}


def test_slurm_leaves_the_gpus_slurm_bound(monkeypatch, no_tools):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
  srun_env(monkeypatch, "gpu[07-08]", ["gpu07", "gpu08"], 1, 1)
  info = cluster.from_resolver(cluster.slurm_resolver())
  assert info.address == "gpu08:8888" and info.worker_index == 1
  assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_slurm_several_tasks_per_node(monkeypatch, no_tools):
  srun_env(monkeypatch, "node[01-02]", ["node01", "node02"], 2, 3)
  info = cluster.from_resolver(cluster.slurm_resolver(port_base=9000))
  assert info.jobs == {"worker": ("node01:9000", "node01:9001",
                                  "node02:9000", "node02:9001")}
  assert (info.worker_index, info.address) == (3, "node02:9001")


@pytest.mark.parametrize("nodelist, nodes, k, procid, node, local_id", [
    # Slurm's order is node9, node10; the resolver sorts "node10" first.
    ("node[9-10]", ["node9", "node10"], 1, 0, None, None),
    # Cyclic distribution: rank 1 on the second node, not the first.
    ("node[01-02]", ["node01", "node02"], 2, 1, "node02", 0),
])
def test_slurm_rank_placement_the_resolver_cannot_express_is_refused(
    monkeypatch, no_tools, nodelist, nodes, k, procid, node, local_id):
  srun_env(monkeypatch, nodelist, nodes, k, procid, node, local_id)
  with pytest.raises(ClusterConfigError, match="rank .* the address"):
    cluster.slurm_resolver()


def test_slurm_outside_a_job_step_is_a_clear_error(monkeypatch, no_tools):
  srun_env(monkeypatch, "node[01-02]", ["node01", "node02"], 1, 0)
  for name in ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NODELIST",
               "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS",
               "SLURM_STEP_TASKS_PER_NODE"):
    monkeypatch.delenv(name)  # the batch script itself, not under srun
  with pytest.raises(ClusterConfigError, match="srun"):
    cluster.slurm_resolver()


def test_slurm_bad_nodelist_is_a_clear_error(monkeypatch, no_tools):
  srun_env(monkeypatch, "node[01-02", ["node01", "node02"], 1, 0)
  with pytest.raises(ClusterConfigError, match="SlurmClusterResolver"):
    cluster.slurm_resolver()


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
  """`scontrol show hostnames node[9-10]` as Slurm answers it."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  path = bin_dir / "scontrol"
  path.write_text('#!/bin/sh\n[ "$*" = "show hostnames node[9-10]" ] || '
                  'exit 1\nprintf "node9\\nnode10\\n"\n')
  path.chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def run_slurm_tf_config(*args):
  return subprocess.run(
      [sys.executable, str(RECIPES / "slurm_tf_config.py"), *args],
      capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.parametrize("procid, node", [(0, "node9"), (1, "node10")])
def test_slurm_tf_config_fallback_follows_slurms_node_order(
    monkeypatch, fake_scontrol, procid, node):
  srun_env(monkeypatch, "node[9-10]", ["node9", "node10"], 1, procid)
  run = run_slurm_tf_config("--port", "2345")
  assert run.returncode == 0, run.stderr
  info, via_resolver = both_paths(monkeypatch, run.stdout.strip())
  assert info == via_resolver
  assert info.jobs == {"worker": ("node9:2345", "node10:2345")}
  assert (info.worker_index, info.address) == (procid, f"{node}:2345")


def test_slurm_tf_config_fallback_wants_one_task_per_node(monkeypatch,
                                                          fake_scontrol):
  srun_env(monkeypatch, "node[9-10]", ["node9", "node10"], 2, 1)
  run = run_slurm_tf_config()
  assert run.returncode != 0 and "one task per node" in run.stderr


@pytest.mark.parametrize("kind", RESOLVER_KINDS)
def test_strategy_takes_the_recipe_resolvers(monkeypatch, no_tools,
                                             fresh_runtime, kind):
  # One-worker clusters: the strategy starts no server for them.
  if kind == "slurm":
    srun_env(monkeypatch, "node01", ["node01"], 1, 0)
    resolver = cluster.slurm_resolver(port_base=23456)
  else:
    monkeypatch.setenv("TF_CONFIG", kubeflow_tf_config(
        "solo", "default", {"Worker": 1}, "Worker", 0))
    resolver = TFConfigClusterResolver()
  strategy = oscars_tf.OscarsStrategy(cluster_resolver=resolver)
  assert (strategy.num_workers, strategy.worker_index) == (1, 0)
  assert strategy.is_chief
  assert strategy.cluster == cluster.from_resolver(resolver)
  assert strategy.cluster.address == {
      "slurm": "node01:23456",
      "tf_config": "solo-worker-0.default.svc:2222"}[kind]
