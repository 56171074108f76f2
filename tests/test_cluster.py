"""Tests for oscars_tf.cluster: TF_CONFIG and resolver validation."""

import json
import socket

import pytest
import tensorflow as tf

from oscars_tf import cluster
from oscars_tf.errors import ClusterConfigError


def _config(cluster_spec, task_type="worker", index=0):
  return json.dumps({"cluster": cluster_spec,
                     "task": {"type": task_type, "index": index}})


def test_no_config_is_one_local_worker():
  info = cluster.from_tf_config("")
  assert not info.is_multi_worker and info.worker_index == 0


def test_chief_comes_first():
  text = _config({"chief": ["h:1"], "worker": ["h:2", "h:3"]}, "worker", 1)
  info = cluster.from_tf_config(text)
  assert info.num_workers == 3
  assert info.worker_index == 2 and not info.is_chief
  assert info.device_prefix() == "/job:worker/replica:0/task:1"
  assert info.device_prefix(0) == "/job:chief/replica:0/task:0"


@pytest.mark.parametrize("text, match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"cluster": {"worker": ["h:1"]}}), "no 'task'"),
    (_config({"worker": ["h:1", "h:2"]}, index=2), "out of range"),
    (_config({"worker": ["h:1", "h:2"]}, index=-1), "out of range"),
    (_config({"worker": ["h:1"]}, index="x"), "not an integer"),
    (_config({"worker": ["h:1"]}, "chief"), "not a job"),
    (_config({"worker": ["h:1", "h:1"]}), "more than once"),
    (_config({"worker": ["nohostport"]}), "host:port"),
    (_config({"worker": ["h:99999"]}), "1..65535"),
    (_config({"worker": []}), "at least one"),
    (_config({"worker": ["h:1"], "ps": ["h:2"]}), "'chief' and 'worker'"),
    (_config({"chief": ["h:1", "h:2"]}, "chief"), "at most one 'chief'"),
    (_config({"worker": ["h:1", "h:2"], "coordinator": ["h:3", "h:4"]}),
     "at most one 'coordinator'"),
    (_config({"worker": ["h:1"], "coordinator": ["h:3"]}), "two or more"),
    (_config({"worker": ["h:1", "h:2"], "coordinator": ["h:2"]}),
     "more than once"),
])
def test_bad_tf_config_is_a_clear_error(text, match):
  with pytest.raises(ClusterConfigError, match=match):
    cluster.from_tf_config(text)


def test_a_coordinator_task_hosts_the_service_and_is_no_worker():
  spec = {"chief": ["h:1"], "worker": ["h:2"], "coordinator": ["h:9"]}
  worker = cluster.from_tf_config(_config(spec, "worker", 0))
  assert worker.num_workers == 2 and worker.worker_index == 1
  assert worker.service_leader == "/job:coordinator/replica:0/task:0"
  assert worker.service_address == "h:9"  # the chief's directory reads
  assert not worker.is_coordinator
  host = cluster.from_tf_config(_config(spec, "coordinator", 0))
  assert host.is_coordinator and host.address == "h:9"
  assert host.num_workers == 2 and host.workers[0][2] == "h:1"
  with pytest.raises(ClusterConfigError,
                     match="python -m oscars_tf.cli.coordinator"):
    host.worker_index  # pylint: disable=pointless-statement  # noqa: B018
  # What the strategy hands to TensorFlow's and Keras' multi-worker code
  # leaves it out: TensorFlow's helpers reject a job of that name.
  from tensorflow.python.distribute import multi_worker_util  # pylint: disable=g-import-not-at-top
  resolver = cluster.resolver_for(worker)
  assert sorted(resolver.cluster_spec().jobs) == ["chief", "worker"]
  assert not multi_worker_util.is_chief(resolver.cluster_spec(), "worker", 0)
  assert multi_worker_util.worker_count(resolver.cluster_spec(),
                                        "worker") == 2
  # Without one, the chief hosts it.
  plain = cluster.from_tf_config(_config({"worker": ["h:1", "h:2"]}))
  assert plain.service_leader == "/job:worker/replica:0/task:0"
  assert plain.service_address == "h:1"


def test_resolver_path():
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec({"worker": ["localhost:1", "localhost:2"]}),
      task_type="worker", task_id=1, rpc_layer="grpc")
  info = cluster.from_resolver(resolver)
  assert (info.num_workers, info.worker_index) == (2, 1)


def test_resolver_out_of_range_task():
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec({"worker": ["localhost:1"]}),
      task_type="worker", task_id=3)
  with pytest.raises(ClusterConfigError, match="out of range"):
    cluster.from_resolver(resolver)


def test_busy_port_is_reported_before_tensorflow_binds_it():
  with socket.socket() as holder:
    holder.bind(("0.0.0.0", 0))
    holder.listen()
    port = holder.getsockname()[1]
    info = cluster.from_dict({"worker": [f"localhost:{port}", "localhost:1"]},
                             "worker", 0)
    with pytest.raises(ClusterConfigError, match="already in use"):
      cluster.check_port_free(info)


def test_connection_refused_tells_a_gone_process_from_a_stopped_one():
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    # Listening but never accepting, like a stopped process: not gone.
    assert not cluster.connection_refused(address)
  assert cluster.connection_refused(address)  # nothing listens now
  assert not cluster.connection_refused("not-an-address")
