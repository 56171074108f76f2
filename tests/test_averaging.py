"""Tests for oscars_tf.runtime.averaging.

NCCL cannot run on these CPU-only machines: the NCCL paths are tested for the
choice they make and for the ops they build (traced, never executed).
"""

import pytest
import tensorflow as tf

from oscars_tf.runtime import averaging


@pytest.mark.parametrize("requested, types, hosts, expected", [
    ("auto", ["GPU", "GPU"], ["a", "a"], "NCCL"),
    ("auto", ["GPU", "GPU"], ["a", "b"], "RING"),
    ("auto", ["GPU", "CPU"], ["a", "a"], "RING"),
    ("auto", ["CPU", "CPU"], ["a", "a"], "RING"),
    ("ring", ["GPU", "GPU"], ["a", "a"], "RING"),
    ("nccl", ["GPU", "GPU"], ["a", "b"], "NCCL"),
])
def test_choose_communication(requested, types, hosts, expected):
  assert averaging.choose_communication(requested, types, hosts) == expected


def test_nccl_on_cpu_is_a_clear_error():
  with pytest.raises(ValueError, match="every member on a GPU"):
    averaging.choose_communication("nccl", ["CPU"], ["a"])
  with pytest.raises(ValueError, match="one of"):
    averaging.choose_communication("mpi", ["CPU"], ["a"])


def _collective_ops(averager, tensors):
  fn = tf.function(lambda: averager.weighted_sum(tensors, 0.5))
  graph = fn.get_concrete_function().graph
  return [op for op in graph.get_operations()
          if op.type == "CollectiveReduceV2"]


@pytest.mark.parametrize("hint", ["NCCL", "RING"])
def test_built_ops_carry_keys_timeout_and_communication(hint):
  device = "/device:GPU:0" if hint == "NCCL" else "/device:CPU:0"
  averager = averaging.GroupAverager(3, 1234567, device, hint, timeout=7.0)
  ops = _collective_ops(averager, [tf.ones([2, 3]), tf.ones([4])])
  assert len(ops) == 1  # packed: one collective for the float32 tensors
  op = ops[0]
  assert op.get_attr("communication_hint").decode() == hint.lower()
  assert op.get_attr("timeout_seconds") == pytest.approx(7.0)
  assert op.get_attr("merge_op").decode() == "Add"
  assert device.lower() in op.device.lower()
  consts = {i.op.name: tf.get_static_value(i) for i in op.inputs[1:4]}
  assert 3 in consts.values() and 1234567 in consts.values()


def test_one_collective_per_dtype():
  averager = averaging.GroupAverager(2, 99, "/device:CPU:0", "RING", 5.0)
  tensors = [tf.ones([3]), tf.ones([2], tf.float16), tf.ones([5])]
  assert len(_collective_ops(averager, tensors)) == 2


def test_zero_timeout_is_rejected():
  with pytest.raises(ValueError, match="timeout"):
    averaging.GroupAverager(2, 1, "/device:CPU:0", "RING", timeout=0)


def test_single_member_weighted_sum_is_exact():
  averager = averaging.GroupAverager(1, 4242, "/device:CPU:0", "RING", 5.0)
  a, b = averager.weighted_sum([tf.constant([1.0, 2.0]),
                                tf.constant([[3.0]])], 1.0)
  assert a.numpy().tolist() == [1.0, 2.0] and b.numpy().tolist() == [[3.0]]


def test_per_group_choice_builds_nccl_and_ring_ops():
  """Traced only: both branches exist, with their communication hints."""
  averager = averaging.PerGroupAverager(4, 777, "/device:GPU:0", timeout=9.0)
  fn = tf.function(lambda flag: averager.weighted_sum(
      [tf.ones([3])], 0.25, tf.constant(2), tf.constant(888), flag))
  graph = fn.get_concrete_function(tf.TensorSpec([], tf.bool)).graph
  hints = sorted(
      node.attr["communication_hint"].s.decode()
      for f in graph.as_graph_def().library.function for node in f.node_def
      if node.op == "CollectiveReduceV2")
  assert hints == ["nccl", "ring"]


def test_instance_keys_follow_the_packed_shape_and_stay_in_their_role():
  # TensorFlow fixes a collective instance's shape at its first run: a
  # second model of another size must get other keys; one model, the same
  # keys every round and on every member.
  key = averaging.instance_key
  assert key("model", 0, "float32", 1000) == key("model", 0, "float32", 1000)
  assert key("model", 0, "float32", 1000) != key("model", 0, "float32", 1001)
  assert key("model", 0, "float32", 1000) != key("model", 0, "float16", 1000)
  assert key("model", 0, "float32", 1000) != key("model", 1, "float32", 1000)
  roles = sorted(averaging.INSTANCE_KEY_BASE.items(), key=lambda kv: kv[1])
  for (role, base), (_, next_base) in zip(roles, roles[1:] + [(None, 2**31)]):
    for length in (1, 999, 10**6, 10**9):
      k = key(role, averaging._MAX_PACKS - 1, "float64", length)  # pylint: disable=protected-access
      assert base <= k < min(next_base, base + (1 << 27)) and k < 2**31
