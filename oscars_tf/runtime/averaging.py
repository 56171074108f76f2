"""Collectives: weighted averaging of variables inside a group of workers.

One call packs the tensors of a dtype into one flat buffer and runs one
`CollectiveReduceV2` per dtype with explicit group and instance keys and a
timeout, so a model of any number of variables costs one collective per sync.
Every member receives the same reduced buffer, so right after a sync all
members hold bit-identical values.

With an averaging dtype (bfloat16 or float16) the float32 and float64
tensors are sent in it: each member weights its values in their own dtype,
casts the products down, the collective sums them in the averaging dtype,
and the sum is cast back. Half the bytes of float32; the cost is precision
(see `OscarsStrategy`'s `averaging_dtype`). The full weights are sent, not
their change since the last average: members of one group need not hold
the same last average (groups, rejoined and poisoned workers), and the
result must be the same on every member.

This is the mechanism; the averagers a round chooses among, each with the
one interface `weighted_sum(values, part)`, are in averagers.py.
"""

import contextlib
import zlib

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import collective_ops

from oscars_tf.errors import PeerTimeoutError
from oscars_tf.errors import WorkerLostError
from oscars_tf.runtime import fault_injection
from oscars_tf.runtime import py_function_errors

COMMUNICATIONS = ("auto", "ring", "nccl")
# What `averaging_dtype` may be; "float32" (or None) sends each tensor in its
# own dtype.
AVERAGING_DTYPES = ("float32", "bfloat16", "float16")
# Dtypes NCCL takes in TensorFlow 2.21 (NcclManager's kValidDataTypes:
# half, float, double, int32, int64): no bfloat16.
_NCCL_DTYPES = frozenset({"float16", "float32", "float64", "int32", "int64"})

# Instance keys per role; each role gets a disjoint range of keys.
INSTANCE_KEY_BASE = {"model": 1 << 27, "check": 2 << 27, "racks": 3 << 27,
                     "rack_back": 4 << 27, "across": 5 << 27,
                     "back": 6 << 27, "shared": 7 << 27,
                     # the sharded global sync (sharded_sync.py)
                     "shard_in": 8 << 27, "shard_across": 9 << 27,
                     "shard_racks": 10 << 27, "shard_back": 11 << 27,
                     "shard_out": 12 << 27, "shard_order": 13 << 27,
                     # compressed averaging (compressed.py); the last
                     # range below 2**31
                     "compressed_spread": 14 << 27,
                     "compressed_gather": 15 << 27}
MAX_PACKS = 1 << 10
_SHAPE_SLOTS = 1 << 17  # (1 << 27) // MAX_PACKS


def instance_key(role, pack_index, dtype, length):
  """The instance key of one packed collective.

  TensorFlow fixes an instance's shape at its first run in a process: a
  second model of another size (a user training two models, a fine-tuned
  head) must not reuse the first one's keys. So the key is a function of
  the pack's dtype and length too, the same on every member (which all pack
  the same variables) and the same for every round of one model. Two
  shapes share a key with odds of 1 in 131,072, and then TensorFlow says so
  (a shape mismatch) instead of averaging wrongly.
  """
  slot = zlib.crc32(f"{dtype}:{length}".encode()) % _SHAPE_SLOTS
  return INSTANCE_KEY_BASE[role] + slot * MAX_PACKS + pack_index


def instance_key_of_cut(role, pack_index, dtype, length, cut):
  """`instance_key`, for a collective whose shape also depends on `cut`
  (an integer tensor below 1 << 31, the same for one shape: how the pack
  is cut). A group may outlive a cut (the same members, after another host
  lost one), and TensorFlow would refuse the new shape under the old key.
  `pack_index` may be a tensor."""
  slot = zlib.crc32(f"{dtype}:{length}".encode()) % _SHAPE_SLOTS
  mixed = tf.math.floormod(slot + tf.cast(cut, tf.int64) * 40503,
                           _SHAPE_SLOTS)
  return INSTANCE_KEY_BASE[role] + tf.cast(mixed, tf.int32) * MAX_PACKS + (
      pack_index)


def choose_communication(requested, device_types, hosts):
  """Picks the collective implementation for a group.

  Args:
    requested: "auto", "ring" or "nccl".
    device_types: device type ("GPU"/"CPU") of each member's averaging device.
    hosts: host name of each member.

  Returns:
    "NCCL" or "RING" — the `communication_hint` the collective ops get.
    "auto" picks NCCL only when every member is a GPU on one host; NCCL
    between hosts needs a network NCCL can use, so gRPC ring is the safe
    default there.
  """
  if requested not in COMMUNICATIONS:
    raise ValueError(f"`communication` must be one of {COMMUNICATIONS}, got "
                     f"{requested!r}.")
  all_gpu = all(t.upper() == "GPU" for t in device_types)
  if requested == "nccl":
    if not all_gpu:
      raise ValueError("communication='nccl' needs every member on a GPU; "
                       f"got device types {sorted(set(device_types))}. "
                       "Use 'ring' or 'auto'.")
    return "NCCL"
  if requested == "ring":
    return "RING"
  return "NCCL" if all_gpu and len(set(hosts)) == 1 else "RING"


def averaging_dtype_of(value):
  """The dtype averagings are sent in: None (each tensor's own), bfloat16 or
  float16.

  Args:
    value: None, "float32", "bfloat16", "float16", or one of those as a
      `tf.DType`.

  Raises:
    ValueError: for anything else, naming `averaging_dtype` and the allowed
      values.
  """
  name = value.name if isinstance(value, tf.DType) else value
  if value is not None and name not in AVERAGING_DTYPES:
    raise ValueError(f"`averaging_dtype` must be None or one of "
                     f"{AVERAGING_DTYPES} (a string or tf.DType), got "
                     f"{value!r}.")
  return None if name in (None, "float32") else tf.as_dtype(name)


def wire_dtype(averaging_dtype, on_gpu):
  """(the dtype actually sent, a warning or None) for a worker whose
  averaging device is a GPU (`on_gpu`: NCCL, or "auto" on GPUs) or not.

  TensorFlow 2.21's NCCL collectives refuse bfloat16 ("expected data types
  compatible with NCCL"), so on a GPU bfloat16 falls back to float16: the
  same bytes, 3 more mantissa bits, range up to 65504 only.
  """
  if averaging_dtype is None or not on_gpu or (
      averaging_dtype.name in _NCCL_DTYPES):
    return averaging_dtype, None
  return tf.float16, (
      f"averaging_dtype={averaging_dtype.name!r}: TensorFlow's NCCL "
      "collectives do not take it (half, float, double, int32 and int64 "
      "only); averaging in float16 instead (same bytes, 11 significant "
      "bits; a weight beyond 65504 would overflow to inf on every member).")


def sent_dtype(dtype, averaging_dtype):
  """The dtype a tensor of `dtype` is sent in: the averaging dtype for
  float32 and float64 tensors, else its own (16-bit floats, integers)."""
  dtype = tf.as_dtype(dtype)
  if averaging_dtype is not None and dtype in (tf.float32, tf.float64):
    return tf.as_dtype(averaging_dtype)
  return dtype


# What a collective raises when a peer died, stalled or aborted.
PEER_ERRORS = (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
               tf.errors.CancelledError, tf.errors.AbortedError)


def packs_by_dtype(tensors, averaging_dtype=None):
  """(dtype sent, indices of the tensors sent in it), in a fixed order."""
  by_dtype = {}
  for i, t in enumerate(tensors):
    by_dtype.setdefault(sent_dtype(t.dtype, averaging_dtype).name,
                        []).append(i)
  return [(tf.as_dtype(k), by_dtype[k]) for k in sorted(by_dtype)]


def weighted_pack(tensors, indices, weight, dtype):
  """The tensors at `indices`, flat, one after another, in `dtype`, each
  weighted in its own dtype before the cast: a weight is not rounded (0.3
  in bfloat16 is 0.30078, and the weights would no longer sum to 1), only
  the products are."""
  return tf.concat([
      tf.cast(tf.reshape(tensors[i], [-1]) *
              tf.cast(weight, tensors[i].dtype), dtype)
      for i in indices], 0)


def unpack(flat, tensors, indices, out):
  """Puts `flat` (a pack of `weighted_pack`) back in `out` at `indices`,
  in the shapes and dtypes of `tensors`."""
  sizes = [int(np.prod(tensors[i].shape)) for i in indices]
  for i, part in zip(indices, tf.split(flat, sizes)):
    out[i] = tf.cast(tf.reshape(part, tensors[i].shape), tensors[i].dtype)


class GroupAverager:
  """Weighted sum of tensors across the members of one group.

  Each member passes its tensors and its weight; every member gets back
  `sum_m weight_m * tensors_m`. Weights summing to 1 give a weighted
  average; a one-hot weight gives a broadcast from that member. `reduce`
  is the mechanism: one packed `CollectiveReduceV2` a dtype sent, with
  explicit keys; `weighted_sum(values, part)` is the averagers' interface
  (runtime/averagers.py): the group, key and weight a round's `RoundPart`
  names.

  Args:
    group_size: number of members.
    group_key: collective group key (see group_keys.py).
    device: device the collective runs on (this member's averaging device).
    communication: "RING" or "NCCL" (see `choose_communication`).
    timeout: seconds a member waits for the others before the collective
      fails with DeadlineExceeded; never 0, so nothing hangs.
    averaging_dtype: None (each tensor in its own dtype), tf.bfloat16 or
      tf.float16 (float32 and float64 tensors are sent in it; see
      `sent_dtype`). Every member must use the same.
    role: "model" (default), the collectives' instance keys (see
      `instance_key`).
    exact: False (default); True sends every tensor in its own dtype,
      whatever the averaging dtype (state that must stay as it is, such as
      the outer optimizer's).

  Example:
    averager = GroupAverager(1, 4242, "/device:CPU:0", "RING", timeout=5.0)
    averager.reduce([tf.constant([1.0, 2.0])], 1.0)  # alone: its values
  """

  def __init__(self, group_size, group_key, device, communication, timeout,
               averaging_dtype=None, role="model", exact=False):
    if timeout <= 0:
      raise ValueError(f"collective timeout must be > 0 s, got {timeout!r}.")
    self.group_size = group_size
    self.group_key = group_key
    self.device = device
    self.communication = communication
    self.timeout = float(timeout)
    self.averaging_dtype = averaging_dtype
    self.role = role
    self.exact = exact

  def _all_reduce(self, flat, instance_key, merge_op="Add", group_size=None,
                  group_key=None):
    with tf.device(self.device):
      return collective_ops.all_reduce_v2(
          flat,
          group_size=self.group_size if group_size is None else group_size,
          group_key=self.group_key if group_key is None else group_key,
          instance_key=instance_key, merge_op=merge_op, final_op="Id",
          communication_hint=self.communication, timeout=self.timeout)

  def weighted_sum(self, values, part):
    """The sum over `part`'s group (`part.group_size`, `part.group_key`),
    this member weighted by `part.weight` (tensors of a RoundPart)."""
    return self.reduce(values, part.weight, group_size=part.group_size,
                       group_key=part.group_key)

  def reduce(self, tensors, weight, role=None, group_size=None,
             group_key=None, exact=None):
    """Returns `sum over members of weight * tensors` (same structure, same
    dtypes).

    `group_size` and `group_key` may be tensors, overriding the averager's
    own, so one op serves whichever group a plan puts this member in;
    `role` and `exact` (None: the averager's own), see the class.
    """
    role = self.role if role is None else role
    exact = self.exact if exact is None else exact
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    out = list(tensors)
    previous = fault_injection.before_collective()  # [] outside tests
    packs = packs_by_dtype(tensors, None if exact else self.averaging_dtype)
    for pack_index, (dtype, indices) in enumerate(packs):
      assert pack_index < MAX_PACKS
      with tf.device(self.device):
        flat = weighted_pack(tensors, indices, weight, dtype)
      # Collectives in one function are ordered explicitly: without an
      # ordering token, two of them may be launched in different orders on
      # different members and deadlock.
      with tf.control_dependencies(previous):
        reduced = self._all_reduce(
            flat, instance_key(role, pack_index, dtype.name, flat.shape[0]),
            group_size=group_size, group_key=group_key)
      previous = [reduced]
      with tf.device(self.device):
        unpack(reduced, tensors, indices, out)
    return out

  def min_max(self, vector, role="check"):
    """Element-wise (min, max) of a float64 vector over the members."""
    vector = tf.cast(tf.convert_to_tensor(vector), tf.float64)
    both = tf.concat([vector, -vector], 0)
    reduced = self._all_reduce(
        both, instance_key(role, 0, "float64", both.shape[0]), merge_op="Max")
    n = int(vector.shape[0])
    return -reduced[n:], reduced[:n]


def packed_bytes(tensors, averaging_dtype=None):
  """Bytes of the tensors one member contributes to an averaging, in the
  dtypes they are sent in (see `sent_dtype`)."""
  return sum(int(np.prod(t.shape)) *
             sent_dtype(t.dtype, averaging_dtype).size for t in tensors)


def sent_bytes(tensors, group_size, averaging_dtype=None):
  """What a member sends averaging `tensors` exactly in a group of
  `group_size` (a tensor), as an int64 tensor: `packed_bytes`, or 0 for a
  member alone, which meets no collective."""
  return tf.where(group_size > 1, tf.constant(
      packed_bytes(tensors, averaging_dtype), tf.int64),
                  tf.constant(0, tf.int64))


def relative_distance(values, averaged):
  """|values - averaged| / |averaged| over the floating tensors (float32):
  a round's divergence."""
  pairs = [(v, a) for v, a in zip(values, averaged) if a.dtype.is_floating]
  if not pairs:
    return tf.constant(0.0)
  num = tf.add_n([tf.reduce_sum(tf.square(tf.cast(v - a, tf.float32)))
                  for v, a in pairs])
  den = tf.add_n([tf.reduce_sum(tf.square(tf.cast(a, tf.float32)))
                  for _, a in pairs])
  return tf.sqrt(num) / (tf.sqrt(den) + 1e-12)


@contextlib.contextmanager
def peer_errors_explained(what, worker, num_workers, timeout,
                          collectives_only=False):
  """Turns a TensorFlow error of a collective at `what` into the clear one:
  PeerTimeoutError when peers did not arrive within `timeout`, else
  WorkerLostError. An exception raised in one of our py_functions comes
  out as itself (see py_function_errors). With `collectives_only`, errors
  of other ops (a user's input pipeline, say) pass unchanged."""
  try:
    yield
  except tf.errors.UnknownError as e:
    raised = py_function_errors.original(e)
    if raised is e:
      raise
    if isinstance(raised, PEER_ERRORS):
      _raise_explained(raised, what, worker, num_workers, timeout,
                       collectives_only)
    # Raised in a round end's py_function (a peer lost to the protocol,
    # a timeout): as itself, without TensorFlow's UnknownError around it.
    raise raised from None
  except PEER_ERRORS as e:
    _raise_explained(e, what, worker, num_workers, timeout, collectives_only)
    raise  # not reached: _raise_explained always raises


def _raise_explained(e, what, worker, num_workers, timeout, collectives_only):
  """Raises the clear error for a collective's TensorFlow error `e`."""
  if collectives_only and "Collective" not in str(e):
    raise e
  if isinstance(e, tf.errors.DeadlineExceededError):
    lost = PeerTimeoutError(
        f"worker {worker}: not every one of the {num_workers} workers "
        f"reached {what} within {timeout:.0f} s (collective_timeout). A "
        "worker may have died, stalled, or stopped training earlier than "
        "the others.")
  else:
    lost = WorkerLostError(
        f"worker {worker}: a peer is gone at {what} ({type(e).__name__}); a "
        "worker may have died or stopped training earlier than the others. "
        "This process's collectives are now aborted: restart the job (from "
        "a checkpoint; oscars-launch --restarts does this).")
  lost.in_collective = True  # a member of this worker's collective is lost
  raise lost from e
