"""Tests for oscars_tf.runtime.averaging.

NCCL cannot run on these CPU-only machines: the NCCL paths are tested for the
choice they make and for the ops they build (traced, never executed).
"""

import threading
import types

import numpy as np
import pytest
import tensorflow as tf

from oscars_tf.runtime import averagers
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
  fn = tf.function(lambda: averager.reduce(tensors, 0.5))
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


def test_a_rounds_part_names_the_group_key_size_and_weight():
  averager = averaging.GroupAverager(4, 99, "/device:CPU:0", "RING", 7.0)
  fn = tf.function(lambda: averager.weighted_sum(
      [tf.ones([2, 3]), tf.ones([4])], _group_part(0.25, 3, 1234567)))
  ops, _ = _reduce_ops(fn)
  assert len(ops) == 1
  consts = [tf.get_static_value(i) for i in ops[0].inputs[1:4]]
  assert consts == [3, 1234567, averaging.instance_key("model", 0,
                                                       "float32", 10)]


def test_every_averager_has_the_one_interface():
  import inspect  # pylint: disable=g-import-not-at-top

  from oscars_tf.runtime import sharded_sync  # pylint: disable=g-import-not-at-top
  for cls in (averaging.GroupAverager, averagers.PerGroupAverager,
              averagers.HierarchicalAverager, sharded_sync.ShardedAverager,
              averagers.AcrossHosts, averagers.UnlessAlone):
    assert list(inspect.signature(cls.weighted_sum).parameters) == [
        "self", "values", "part"], cls


class _Says:
  """An averager whose sum is `value` everywhere (to see which one ran)."""

  def __init__(self, value):
    self.value = value

  def weighted_sum(self, values, part):
    del part
    return [tf.fill(tf.shape(v), self.value) for v in values]


@pytest.mark.parametrize("is_global, sharded, expected", [
    (False, False, 1.0), (False, True, 1.0), (True, False, 2.0),
    (True, True, 3.0)])
def test_across_hosts_a_global_sync_goes_shard_by_shard_or_host_by_host(
    is_global, sharded, expected):
  averager = averagers.AcrossHosts(_Says(1.0), _Says(2.0), _Says(3.0))
  part = types.SimpleNamespace(is_global=tf.constant(is_global),
                               sharded=tf.constant(sharded))
  out, = averager.weighted_sum([tf.zeros([2])], part)
  assert out.numpy().tolist() == [expected] * 2


def test_a_member_alone_keeps_its_values():
  averager = averagers.UnlessAlone(_Says(5.0))
  values = [tf.constant([1.0, 2.0])]
  alone = types.SimpleNamespace(group_size=tf.constant(1))
  assert averager.weighted_sum(values, alone)[0].numpy().tolist() == [1, 2]
  pair = types.SimpleNamespace(group_size=tf.constant(2))
  assert averager.weighted_sum(values, pair)[0].numpy().tolist() == [5, 5]


def test_one_collective_per_dtype():
  averager = averaging.GroupAverager(2, 99, "/device:CPU:0", "RING", 5.0)
  tensors = [tf.ones([3]), tf.ones([2], tf.float16), tf.ones([5])]
  assert len(_collective_ops(averager, tensors)) == 2


def test_zero_timeout_is_rejected():
  with pytest.raises(ValueError, match="timeout"):
    averaging.GroupAverager(2, 1, "/device:CPU:0", "RING", timeout=0)


def test_single_member_weighted_sum_is_exact():
  averager = averaging.GroupAverager(1, 4242, "/device:CPU:0", "RING", 5.0)
  a, b = averager.reduce([tf.constant([1.0, 2.0]),
                          tf.constant([[3.0]])], 1.0)
  assert a.numpy().tolist() == [1.0, 2.0] and b.numpy().tolist() == [[3.0]]


def _group_part(weight, group_size, group_key, nccl=False):
  """The fields of a RoundPart a group's averager reads, as tensors."""
  return types.SimpleNamespace(
      weight=tf.convert_to_tensor(weight),
      group_size=tf.convert_to_tensor(group_size),
      group_key=tf.convert_to_tensor(group_key),
      nccl=tf.convert_to_tensor(nccl))


def test_per_group_choice_builds_nccl_and_ring_ops():
  """Traced only: both branches exist, with their communication hints."""
  averager = averagers.PerGroupAverager(4, 777, "/device:GPU:0", timeout=9.0)
  fn = tf.function(lambda flag: averager.weighted_sum(
      [tf.ones([3])], _group_part(0.25, 2, 888, flag)))
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
      k = key(role, averaging.MAX_PACKS - 1, "float64", length)
      assert base <= k < min(next_base, base + (1 << 27)) and k < 2**31


# -- averaging in bfloat16 / float16 ----------------------------------------


@pytest.mark.parametrize("value, expected", [
    (None, None), ("float32", None), (tf.float32, None),
    ("bfloat16", tf.bfloat16), (tf.bfloat16, tf.bfloat16),
    ("float16", tf.float16), (tf.float16, tf.float16),
])
def test_averaging_dtype_accepts_the_allowed_values(value, expected):
  assert averaging.averaging_dtype_of(value) == expected


@pytest.mark.parametrize("value", [
    "bf16", "float64", tf.float64, "int8", tf.int32, 16, "", "BFLOAT16"])
def test_averaging_dtype_rejects_anything_else_naming_the_choices(value):
  with pytest.raises(ValueError) as e:
    averaging.averaging_dtype_of(value)
  text = str(e.value)
  assert "`averaging_dtype`" in text and repr(value) in text
  for allowed in averaging.AVERAGING_DTYPES:
    assert allowed in text


def test_bfloat16_falls_back_to_float16_on_gpus_only():
  # TensorFlow 2.21's NcclManager takes half/float/double/int32/int64 only.
  assert averaging.wire_dtype(tf.bfloat16, on_gpu=False) == (tf.bfloat16,
                                                             None)
  dtype, warning = averaging.wire_dtype(tf.bfloat16, on_gpu=True)
  assert dtype == tf.float16 and "float16" in warning and "NCCL" in warning
  assert averaging.wire_dtype(tf.float16, on_gpu=True) == (tf.float16, None)
  assert averaging.wire_dtype(None, on_gpu=True) == (None, None)


def test_bytes_of_an_averaging_follow_the_dtype_sent():
  tensors = [tf.ones([3, 4]), tf.ones([5]), tf.ones([2], tf.int32),
             tf.ones([4], tf.float16), tf.ones([1], tf.float64)]
  full = averaging.packed_bytes(tensors)
  assert full == 17 * 4 + 2 * 4 + 4 * 2 + 8
  for dtype in (tf.bfloat16, tf.float16):
    # float32 and float64 go in 2 bytes; int32 and float16 as they are.
    assert averaging.packed_bytes(tensors, dtype) == 18 * 2 + 2 * 4 + 4 * 2
  floats = tensors[:2]
  assert averaging.packed_bytes(floats, tf.bfloat16) * 2 == (
      averaging.packed_bytes(floats))


def _reduce_ops(fn):
  graph = fn.get_concrete_function().graph
  ops = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
  nested = [node for f in graph.as_graph_def().library.function
            for node in f.node_def if node.op == "CollectiveReduceV2"]
  return ops, nested


def test_packs_and_instance_keys_follow_the_dtype_actually_sent():
  averager = averaging.GroupAverager(2, 99, "/device:CPU:0", "RING", 5.0,
                                     averaging_dtype=tf.bfloat16)
  tensors = [tf.ones([3]), tf.ones([2], tf.int32), tf.ones([4], tf.float64)]
  out = []
  ops, _ = _reduce_ops(tf.function(
      lambda: out.extend(averager.reduce(tensors, 0.5)) or 0))
  by_dtype = {op.get_attr("T").name: op for op in ops}
  # float32 and float64 share one bfloat16 pack; the integers keep theirs.
  assert sorted(by_dtype) == ["bfloat16", "int32"]
  keys = {name: tf.get_static_value(op.inputs[3])
          for name, op in by_dtype.items()}
  assert keys["bfloat16"] == averaging.instance_key("model", 0, "bfloat16", 7)
  assert keys["int32"] == averaging.instance_key("model", 1, "int32", 2)
  assert [t.dtype for t in out] == [tf.float32, tf.int32, tf.float64]
  # exact=True (the outer optimizer's state): every tensor in its own dtype.
  exact, _ = _reduce_ops(tf.function(
      lambda: averager.reduce(tensors, 0.5, exact=True)))
  assert sorted(op.get_attr("T").name for op in exact) == [
      "float32", "float64", "int32"]


def test_hierarchical_and_per_group_averaging_send_the_averaging_dtype():
  """Traced only: every collective of a multi-host sync (within hosts,
  across the rack, across racks, back to the rack, back to the host) and
  both NCCL and ring per-group ops send bfloat16."""
  hier = averagers.HierarchicalAverager("/device:CPU:0", "RING", 5.0,
                                        averaging_dtype=tf.bfloat16)
  part = types.SimpleNamespace(
      host_key=tf.constant(5), host_size=tf.constant(2),
      weight_in_host=tf.constant(0.5), is_leader=tf.constant(True),
      leaders_key=tf.constant(6), leaders_size=tf.constant(2),
      host_share=tf.constant(0.5), is_rack_leader=tf.constant(True),
      racks_key=tf.constant(7), racks_size=tf.constant(2),
      rack_share=tf.constant(0.5))
  _, nested = _reduce_ops(tf.function(
      lambda: hier.weighted_sum([tf.ones([3]), tf.ones([2, 2])], part)))
  assert len(nested) == 5
  assert {n.attr["T"].type for n in nested} == {tf.bfloat16.as_datatype_enum}
  per_group = averagers.PerGroupAverager(4, 777, "/device:GPU:0", 9.0,
                                         averaging_dtype=tf.float16)
  _, nested = _reduce_ops(tf.function(lambda: per_group.weighted_sum(
      [tf.ones([3])], _group_part(0.25, 2, 888, True))))
  assert len(nested) == 2
  assert {n.attr["T"].type for n in nested} == {tf.float16.as_datatype_enum}


def _two_members(group_key, values, weights, averaging_dtype):
  """Runs one weighted sum with two members, on the logical CPUs 0 and 1
  of this process (conftest.py), each in its own thread."""
  results, errors = {}, []

  def member(m):
    try:
      averager = averaging.GroupAverager(2, group_key, f"/device:CPU:{m}",
                                         "RING", timeout=30.0,
                                         averaging_dtype=averaging_dtype)
      results[m] = [t.numpy() for t in averager.reduce(
          [tf.constant(v) for v in values[m]], weights[m])]
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=member, args=(m,)) for m in (0, 1)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  assert not any(t.is_alive() for t in threads) and not errors, errors
  return results


@pytest.mark.parametrize("dtype, bits, group_key", [
    (tf.bfloat16, 8, 424201), (tf.float16, 11, 424202)])
def test_a_16_bit_average_is_close_rounded_and_float32(dtype, bits,
                                                       group_key):
  rng = np.random.default_rng(7)
  values = [[rng.normal(size=(64,)).astype(np.float32),
             rng.normal(size=(4, 8)).astype(np.float32)] for _ in range(2)]
  weights = [0.25, 0.75]
  expected = [weights[0] * a + weights[1] * b
              for a, b in zip(values[0], values[1])]
  exact = _two_members(group_key + 100, values, weights, None)
  # Powers of two as weights: the float32 collective gives the exact sum.
  for got in exact.values():
    for g, e in zip(got, expected):
      np.testing.assert_array_equal(g, e)
  got = _two_members(group_key, values, weights, dtype)
  for g0, g1 in zip(got[0], got[1]):
    np.testing.assert_array_equal(g0, g1)  # every member: the same values
  for g, e, a, b in zip(got[0], expected, values[0], values[1]):
    assert g.dtype == np.float32 and g.shape == e.shape
    # Three roundings (two products, one sum), each within 2**-bits of its
    # value: relative to the terms, since they may cancel.
    bound = 2.0**-bits * (weights[0] * np.abs(a) + weights[1] * np.abs(b) +
                          np.abs(e))
    assert np.all(np.abs(g - e) <= bound), np.max(np.abs(g - e) / bound)
    # ... and really rounded: most values differ from the float32 average,
    # and every one is a value of the 16-bit dtype.
    assert np.mean(g != e) > 0.5
    np.testing.assert_array_equal(
        g, g.astype(dtype.as_numpy_dtype).astype(np.float32))
