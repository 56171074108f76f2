"""Tests for the multi-host recipes in examples/cluster/.

TF_CONFIG as the Kubeflow training operator sets it and the Slurm variables
as srun sets them, resolved by oscars_tf.cluster and by TensorFlow's cluster
resolvers; and the committed recipe files, checked against each other. No
server is started: multi-worker clusters are only resolved, and the strategy
itself is built for one-worker clusters (which start none). The
one-command-per-node recipes (oscars-launch --nnodes) are checked against
the launcher's own flags: the batch script runs under a fake srun that
starts a fake oscars-launch, and the Job's command is expanded per index as
Kubernetes does.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

from absl import flags
import pytest
import tensorflow as tf

import oscars_tf
from oscars_tf import cluster
from oscars_tf.cli import launch
from oscars_tf.cli import multi_node
from oscars_tf.errors import ClusterConfigError
from oscars_tf.runtime import server
from oscars_tf.tools import job_layout

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
               "slurm_train.sbatch", "slurm_tf_config.py", "tfjob.yaml",
               "slurm_launch.sbatch", "k8s_indexed_job.yaml"):
    assert name in texts["README.md"]
  # oscars-launch gives its workers TF_CONFIG.
  assert used["slurm_launch.sbatch"] == {"tf_config"}
  assert used["k8s_indexed_job.yaml"] == {"tf_config"}


def _train_py_commands():
  """Every train.py command line of the recipes, from train.py on."""
  readme = (RECIPES / "README.md").read_text()
  chunks = re.findall(r"```sh\n(.*?)```", readme, re.S)
  chunks.append((RECIPES / "slurm_train.sbatch").read_text())
  chunks.append(" ".join(manifest_facts()["command"]))
  return [c[c.index("examples/train.py"):] for c in chunks
          if "examples/train.py" in c]


def train_py_flags():
  """The names of the flags examples/train.py defines."""
  root = RECIPES.parents[1]
  defined = set()
  for path in ("examples/train.py", "oscars_tf/cli/flags.py"):
    defined |= set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"",
                              (root / path).read_text()))
  return defined


def test_recipes_pass_only_flags_train_py_defines():
  defined = train_py_flags()
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


# --- One command per node: oscars-launch --nnodes ---------------------------

SLURM_LAUNCH = RECIPES / "slurm_launch.sbatch"
INDEXED_JOB = RECIPES / "k8s_indexed_job.yaml"
RENDEZVOUS_PORT = 29400  # the recipes' and the README's


def _yaml_scalar(text):
  """A scalar as YAML reads those these manifests hold."""
  if text[:1] in ("'", '"'):
    return text[1:-1]  # no escapes in these files
  if re.fullmatch(r"-?\d+", text):
    return int(text)
  return {"true": True, "false": False, "null": None}.get(text, text)


_YAML_KEY = re.compile(r"([\w./-]+):(?: +(.*))?")


def _is_item(line):
  return line == "-" or line.startswith("- ")


def _yaml_block(lines, i):
  """(value of the block of lines (indent, text) from i, index after it)."""
  indent = lines[i][0]
  if _is_item(lines[i][1]):
    items = []
    while i < len(lines) and lines[i][0] == indent and _is_item(lines[i][1]):
      rest = lines[i][1][1:].lstrip(" ")
      if not rest:
        value, i = _yaml_block(lines, i + 1)
      elif _YAML_KEY.fullmatch(rest):
        # "- key: ...": a mapping whose keys line up with this one.
        lines[i] = (indent + len(lines[i][1]) - len(rest), rest)
        value, i = _yaml_block(lines, i)
      else:
        value, i = _yaml_scalar(rest), i + 1
      items.append(value)
    return items, i
  mapping = {}
  while (i < len(lines) and lines[i][0] == indent and
         not _is_item(lines[i][1])):
    match = _YAML_KEY.fullmatch(lines[i][1])
    if not match:
      raise ValueError(f"not a key: {lines[i][1]!r}")
    key, value = match.groups()
    i += 1
    if value:
      mapping[key] = _yaml_scalar(value)
    elif i < len(lines) and (lines[i][0] > indent or (
        lines[i][0] == indent and _is_item(lines[i][1]))):
      mapping[key], i = _yaml_block(lines, i)
    else:
      mapping[key] = None
  return mapping, i


def read_block_yaml(text):
  """The documents of `text` without PyYAML (not a dependency): the block
  mappings, sequences and plain or quoted scalars these manifests use."""
  docs = []
  for doc in re.split(r"(?m)^---\n", _strip_comments(text)):
    lines = [(len(line) - len(line.lstrip(" ")), line.strip())
             for line in doc.splitlines() if line.strip()]
    if lines:
      value, end = _yaml_block(lines, 0)
      if end != len(lines):
        raise ValueError(f"unread: {lines[end][1]!r}")
      docs.append(value)
  return docs


@pytest.mark.parametrize("name", ["tfjob.yaml", "k8s_indexed_job.yaml"])
def test_text_reading_of_the_manifests_matches_yaml(name):
  yaml = pytest.importorskip("yaml")
  text = (RECIPES / name).read_text()
  assert read_block_yaml(text) == list(yaml.safe_load_all(text))


def indexed_job_manifest():
  """{kind: object} of k8s_indexed_job.yaml."""
  text = INDEXED_JOB.read_text()
  try:
    import yaml  # pylint: disable=g-import-not-at-top
    docs = list(yaml.safe_load_all(text))
  except ImportError:
    docs = read_block_yaml(text)
  objects = {doc["kind"]: doc for doc in docs}
  assert sorted(objects) == ["Job", "NetworkPolicy", "Service"]
  assert len(docs) == len(objects)
  return objects


def launcher_flag_names():
  fv = flags.FlagValues()
  launch.define_flags(fv)
  return set(fv)


def parse_launch(argv):
  """(the launcher's flags, parsed, and the worker command) of the command
  line argv: oscars-launch FLAGS -- COMMAND."""
  assert os.path.basename(argv[0]) == "oscars-launch"
  split = argv.index("--")
  names = {re.match(r"--(\w+)", arg).group(1) for arg in argv[1:split]}
  assert names <= launcher_flag_names(), names - launcher_flag_names()
  fv = flags.FlagValues()
  launch.define_flags(fv)
  assert fv(argv[:split]) == argv[:1]
  return fv, argv[split + 1:]


def assert_trains_with_train_py(command):
  assert command[:2] == ["python", "examples/train.py"]
  used = {re.fullmatch(r"--(\w+)=.+", arg).group(1) for arg in command[2:]}
  assert {"strategy", "cluster_resolver", "logdir", "checkpoint_dir",
          "result_json"} <= used <= train_py_flags(), used - train_py_flags()
  assert "--strategy=oscars" in command
  assert "--cluster_resolver=tf_config" in command  # what the launcher sets


def assert_launcher_accepts(fv):
  """multi_node.check_flags passes the node flags in `fv`, with loopback
  for the addresses (the recipes' names resolve only in their clusters)."""
  host, _, port = fv.rendezvous.rpartition(":")
  assert host and int(port) == RENDEZVOUS_PORT
  fv.rendezvous = f"127.0.0.1:{port}"
  if fv["host"].present:
    fv.host = "127.0.0.1"
  assert multi_node.check_flags(fv) == ("127.0.0.1", RENDEZVOUS_PORT)


def test_one_command_per_node_recipes_pass_only_launcher_flags():
  readme = (RECIPES / "README.md").read_text()
  texts = re.findall(r"```sh\n(.*?)```", readme, re.S)
  texts.append(re.sub(r"(?m)^\s*#.*$", "", SLURM_LAUNCH.read_text()))
  (container,) = indexed_job_manifest()["Job"]["spec"]["template"]["spec"][
      "containers"]
  texts.append(" ".join(container["command"]))
  launches = [m.group(1) for text in texts
              for m in re.finditer(r"oscars-launch[\s\\]+(--.*?)\s--\s", text,
                                      re.S)]
  assert len(launches) >= 3  # the README's, the batch script's, the Job's
  for flags_text in launches:
    used = set(re.findall(r"(?:^|\s)--(\w+)", flags_text))
    assert {"nnodes", "node_rank", "rendezvous"} <= used
    assert used <= launcher_flag_names(), (used - launcher_flag_names(),
                                           flags_text)


# The Kubernetes indexed Job.


def expand_k8s(arg, values):
  """arg with Kubernetes' $(NAME) references replaced from values."""
  return re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], arg)


def indexed_job_launches():
  """(index, the launcher's flags, the worker command) of each pod."""
  spec = indexed_job_manifest()["Job"]["spec"]
  (container,) = spec["template"]["spec"]["containers"]
  env = {var["name"]: var for var in container.get("env", [])}
  # The Job controller sets JOB_COMPLETION_INDEX; the rest is the pod's.
  referenced = set(re.findall(r"\$\((\w+)\)", " ".join(container["command"])))
  assert referenced <= set(env) | {"JOB_COMPLETION_INDEX"}
  launches = []
  for index in range(spec["completions"]):
    values = {"JOB_COMPLETION_INDEX": str(index),
              "POD_IP": f"10.8.{index}.17"}
    argv = [expand_k8s(arg, values) for arg in container["command"]]
    launches.append((index, *parse_launch(argv)))
  return launches


def test_indexed_job_runs_one_launcher_per_index():
  spec = indexed_job_manifest()["Job"]["spec"]
  assert spec["completionMode"] == "Indexed"
  # All nodes at once, one pod each: the rendezvous waits for all of them.
  nodes = spec["completions"]
  assert nodes == spec["parallelism"] >= 2
  # A pod restarted alone cannot rejoin: the first failure fails the job.
  assert spec["backoffLimit"] == 0
  assert spec["template"]["spec"]["restartPolicy"] == "Never"
  (container,) = spec["template"]["spec"]["containers"]
  assert "--node_rank=$(JOB_COMPLETION_INDEX)" in container["command"]
  pod_ip = {var["name"]: var for var in container["env"]}["POD_IP"]
  assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
  launches = indexed_job_launches()
  assert [index for index, _, _ in launches] == list(range(nodes))
  assert len({fv.rendezvous for _, fv, _ in launches}) == 1
  for index, fv, command in launches:
    assert (fv.nnodes, fv.node_rank) == (nodes, index)
    assert fv.host == f"10.8.{index}.17" and fv["host"].present
    assert fv.network == "host" and fv.num_workers >= 1
    assert_trains_with_train_py(command)
    assert all(arg.startswith("--") and arg.count("=") == 1
               for arg in command[2:])
    assert_launcher_accepts(fv)


def test_indexed_job_rendezvous_names_pod_0_through_its_headless_service():
  objects = indexed_job_manifest()
  service, job = objects["Service"], objects["Job"]
  template = job["spec"]["template"]
  (_, fv, _), *_ = indexed_job_launches()
  host, _, port = fv.rendezvous.rpartition(":")
  # An indexed Job's pod i has the host name <job>-<i>; with `subdomain`,
  # the headless Service's DNS names it <job>-<i>.<subdomain>.
  assert host == f"{job['metadata']['name']}-0.{template['spec']['subdomain']}"
  assert template["spec"]["subdomain"] == service["metadata"]["name"]
  namespaces = {obj["metadata"].get("namespace") for obj in objects.values()}
  assert len(namespaces) == 1
  assert service["spec"]["clusterIP"] == "None"  # headless
  assert service["spec"]["publishNotReadyAddresses"] is True
  selector = service["spec"]["selector"]
  assert selector and selector.items() <= template["metadata"]["labels"].items()
  assert int(port) in [p["port"] for p in service["spec"]["ports"]]
  # The launcher resolves --rendezvous once: the pods first wait for it.
  (init,) = template["spec"]["initContainers"]
  assert init["image"] == template["spec"]["containers"][0]["image"]
  assert f"getent hosts {host};" in " ".join(init["command"])
  assert all(isinstance(arg, str) for arg in init["command"])


def test_indexed_job_network_policy_admits_only_the_jobs_pods_on_its_ports(
    monkeypatch):
  objects = indexed_job_manifest()
  policy, labels = objects["NetworkPolicy"], objects["Job"]["spec"][
      "template"]["metadata"]["labels"]
  selector = policy["spec"]["podSelector"]["matchLabels"]
  assert selector and selector.items() <= labels.items()
  assert policy["spec"]["policyTypes"] == ["Ingress"]
  (rule,) = policy["spec"]["ingress"]
  assert rule["from"] == [{"podSelector": {"matchLabels": selector}}]
  assert {p["protocol"] for p in rule["ports"]} == {"TCP"}
  ranges = [(p["port"], p.get("endPort", p["port"])) for p in rule["ports"]]

  def admitted(port):
    return any(low <= port <= high for low, high in ranges)

  assert admitted(RENDEZVOUS_PORT)
  # The workers' ports: each launcher draws free ones below the kernel's
  # ephemeral range (job_layout.free_ports), 10000-32767 by default.
  assert ranges[-1] == (10000, 32767)
  monkeypatch.setattr(job_layout, "_ephemeral_range", lambda: (32768, 60999))
  assert all(admitted(port) for port in job_layout.free_ports(32))


# The Slurm batch script.


def test_slurm_batch_scripts_parse():
  for path in (SLURM_LAUNCH, RECIPES / "slurm_train.sbatch"):
    run = subprocess.run(["bash", "-n", str(path)], capture_output=True,
                         text=True, timeout=30, check=False)
    assert run.returncode == 0, run.stderr


SLURM_NODES = ("node9", "node10", "node11")  # Slurm's order, node 0 first


def _fake_tool(path, text):
  path.write_text(text)
  path.chmod(0o755)


def run_slurm_launch(tmp_path, monkeypatch, workers_per_node=None):
  """Runs slurm_launch.sbatch as sbatch would on node 0 of SLURM_NODES, with
  an srun that runs its command once per node, as that node's task, and an
  oscars-launch that records its arguments. The records, one per task."""
  bin_dir, records = tmp_path / "bin", tmp_path / "launches.jsonl"
  bin_dir.mkdir()
  nodelist = "node[9-11]"
  _fake_tool(bin_dir / "scontrol", (
      f'#!/bin/sh\n[ "$*" = "show hostnames {nodelist}" ] || exit 1\n'
      f"printf '%s\\n' {' '.join(SLURM_NODES)}\n"))
  # srun: skips its options, then runs the command once per node with the
  # variables of that node's task of the step.
  _fake_tool(bin_dir / "srun", (
      '#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do\n'
      f'  echo "$1" >> "{tmp_path}/srun_options"; shift\ndone\ni=0\n'
      f"for node in {' '.join(SLURM_NODES)}; do\n"
      f"  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_NNODES={len(SLURM_NODES)} "
      'SLURMD_NODENAME=$node "$@" || exit\n'
      "  i=$((i + 1))\ndone\n"))
  _fake_tool(bin_dir / "oscars-launch", (
      f"#!{sys.executable}\nimport json, os, sys\n"
      f"with open({str(records)!r}, 'a') as f:\n"
      "  f.write(json.dumps({'argv': sys.argv, 'env': {k: v for k, v in "
      "os.environ.items() if k.startswith('SLURM')}}) + '\\n')\n"))
  submit = tmp_path / "submit"
  submit.mkdir()
  env = {
      # The batch script's own environment, on node 0 of the job.
      "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": nodelist,
      "SLURM_NNODES": str(len(SLURM_NODES)), "SLURM_NODEID": "0",
      "SLURM_SUBMIT_DIR": str(submit),
  }
  if workers_per_node is not None:
    env["OSCARS_WORKERS_PER_NODE"] = workers_per_node
  for name in ("RUN_DIR", "OSCARS_WORKERS_PER_NODE", "OSCARS_RENDEZVOUS",
               "OSCARS_RENDEZVOUS_PORT"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  run = subprocess.run(["bash", str(SLURM_LAUNCH)], capture_output=True,
                       text=True, timeout=60, check=False,
                       env={**os.environ, **env}, cwd=tmp_path)
  assert run.returncode == 0, run.stderr
  options = (tmp_path / "srun_options").read_text().split()
  assert "--ntasks-per-node=1" in options
  return [json.loads(line) for line in records.read_text().splitlines()], (
      submit / "runs" / "4242")


@pytest.mark.parametrize("workers_per_node, expected", [(None, 1), ("4", 4)])
def test_slurm_launch_runs_one_launcher_per_node_with_its_own_rank(
    tmp_path, monkeypatch, workers_per_node, expected):
  records, run_dir = run_slurm_launch(tmp_path, monkeypatch, workers_per_node)
  assert len(records) == len(SLURM_NODES)
  for rank, record in enumerate(records):
    fv, command = parse_launch(record["argv"])
    # From SLURM_NNODES and SLURM_NODEID as each task sees them (the batch
    # script's own SLURM_NODEID is 0).
    assert (fv.nnodes, fv.node_rank) == (len(SLURM_NODES), rank)
    assert fv.rendezvous == f"{SLURM_NODES[0]}:{RENDEZVOUS_PORT}"
    assert fv.num_workers == expected and fv.network == "host"
    assert multi_node.job_id(fv, record["env"]) == "4242"  # $SLURM_JOB_ID
    assert_trains_with_train_py(command)
    for name in ("logdir", "checkpoint_dir", "result_json"):
      (path,) = [arg.split("=", 1)[1] for arg in command
                 if arg.startswith(f"--{name}=")]
      assert pathlib.Path(path).parent == run_dir or (
          pathlib.Path(path).parent.parent == run_dir)
    assert_launcher_accepts(fv)
  assert run_dir.is_dir()  # made by the script, on the shared FS
