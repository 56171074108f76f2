"""coordination_store.ContextStore on TensorFlow's real coordination service:
what the protocol relies on (membership.py deletes a whole round of arrivals
with one call, a directory delete; the chief reads them in one directory
read, or key by key from threads). Runs a one-task cluster in a child
process: a process joins one cluster only."""

import pathlib
import subprocess
import sys
import textwrap

import conftest

ROOT = pathlib.Path(__file__).resolve().parent.parent

_CHILD = textwrap.dedent("""
    import copy, socket
    import tensorflow as tf
    from tensorflow.core.protobuf import tensorflow_server_pb2
    from tensorflow.python.eager import context
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from oscars_tf.protocol import kv_store
    from oscars_tf.runtime import coordination_store

    s = socket.socket(); s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]; s.close()
    spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{port}"]})
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader="/job:worker/replica:0/task:0",
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(
            name="worker", num_tasks=1)])
    context.context().enable_collective_ops(tensorflow_server_pb2.ServerDef(
        cluster=spec.as_cluster_def(), job_name="worker", task_index=0,
        protocol="grpc", port=port,
        default_session_config=copy.deepcopy(context.context().config)))
    store = coordination_store.ContextStore(f"127.0.0.1:{port}")
    for j in range(3):
      store.set(f"m/a/5/{j}", str(j))
    store.set("m/a/50", "another round")
    store.set("m/a/5", "the directory's own key")
    store.delete("m/a/5")
    gone = []
    for k in ("m/a/5", "m/a/5/0", "m/a/5/2"):
      try:
        store.get(k, 0.05)
      except kv_store.KeyMissing:
        gone.append(k)
    assert gone == ["m/a/5", "m/a/5/0", "m/a/5/2"], gone
    assert store.get("m/a/50", 1.0) == "another round"
    try:
      store.set("m/a/50", "again")
      raise AssertionError("set overwrote a key")
    except Exception as e:  # the service refuses: kv_store.put deletes first
      assert "exist" in str(e).lower(), e
    kv_store.put(store, "m/a/50", "again")
    assert store.get("m/a/50", 1.0) == "again"
    store.delete("m/never-set")  # absent: no error
    # A round's keys read 16 at a time from threads (the chief's arrivals).
    import time
    for j in range(40):
      store.set(f"m/a/7/{j}", f"row {j}")
    keys = [f"m/a/7/{j}" for j in range(41)]  # the last one never set
    values = kv_store.values_unless_gone(store, keys, time.monotonic() + 0.5)
    assert store.concurrent_reads == 16
    assert values == [f"row {j}" for j in range(40)] + [None], values
    # The whole round in one directory read (the service's GetKeyValueDir):
    # its keys only, not m/a/70's nor the directory's own key.
    store.set("m/a/70", "another round")
    store.set("m/a/7", "the directory's own key")
    assert store.read_dir("m/a/7", 1.0) == {
        f"m/a/7/{j}": f"row {j}" for j in range(40)}
    assert store.read_dir("m/a/8", 1.0) == {}
    # No address: no directory reads (the chief reads key by key).
    assert coordination_store.ContextStore().read_dir("m/a/7", 1.0) is None
    # A service that is not there: None, not an error (the key-by-key
    # reads then say what is wrong).
    unserved = coordination_store.ContextStore("127.0.0.1:1")
    assert unserved.read_dir("m/a/7", 0.5) is None
    print("OK")
""")


def test_the_coordination_service_deletes_a_directory_and_refuses_overwrites():
  proc = subprocess.run(
      [sys.executable, "-c", _CHILD], capture_output=True, text=True,
      timeout=120, cwd=ROOT,
      env=conftest.bare_env(CUDA_VISIBLE_DEVICES="",
                           TF_CPP_MIN_LOG_LEVEL="2"))
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_the_in_memory_store_deletes_a_directory_like_the_service():
  from oscars_tf.protocol import kv_store  # pylint: disable=g-import-not-at-top
  store = kv_store.MemoryStore()
  for key in ("m/a/5/0", "m/a/5/1", "m/a/50", "m/a/5"):
    store.set(key, "x")
  store.delete("m/a/5")
  assert sorted(store.data) == ["m/a/50"]
