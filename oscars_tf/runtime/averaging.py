"""Collectives: weighted averaging of variables inside a group of workers.

One call packs the tensors of a dtype into one flat buffer and runs one
`CollectiveReduceV2` per dtype with explicit group and instance keys and a
timeout, so a model of any number of variables costs one collective per sync.
Every member receives the same reduced buffer, so right after a sync all
members hold bit-identical values.
"""

import contextlib
import zlib

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import collective_ops

from oscars_tf.runtime import fault_injection
from oscars_tf.errors import PeerTimeoutError, WorkerLostError

COMMUNICATIONS = ("auto", "ring", "nccl")

# Instance keys per role; each role gets a disjoint range of keys.
INSTANCE_KEY_BASE = {"model": 1 << 27, "check": 2 << 27, "across": 5 << 27,
                     "back": 6 << 27, "shared": 7 << 27}
_MAX_PACKS = 1 << 10
_SHAPE_SLOTS = 1 << 17  # (1 << 27) // _MAX_PACKS


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
  return INSTANCE_KEY_BASE[role] + slot * _MAX_PACKS + pack_index


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


# What a collective raises when a peer died, stalled or aborted.
PEER_ERRORS = (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
               tf.errors.CancelledError, tf.errors.AbortedError)


def _packs(tensors):
  """Indices of float tensors grouped by dtype, in a fixed order."""
  by_dtype = {}
  for i, t in enumerate(tensors):
    by_dtype.setdefault(t.dtype.name, []).append(i)
  return [by_dtype[k] for k in sorted(by_dtype)]


class GroupAverager:
  """Weighted sum of tensors across the members of one group.

  Each member passes its tensors and its weight; every member gets back
  `sum_m weight_m * tensors_m`. Weights summing to 1 give a weighted
  average; a one-hot weight gives a broadcast from that member.

  Args:
    group_size: number of members.
    group_key: collective group key (see group_keys.py).
    device: device the collective runs on (this member's averaging device).
    communication: "RING" or "NCCL" (see `choose_communication`).
    timeout: seconds a member waits for the others before the collective
      fails with DeadlineExceeded; never 0, so nothing hangs.
  """

  def __init__(self, group_size, group_key, device, communication, timeout):
    if timeout <= 0:
      raise ValueError(f"collective timeout must be > 0 s, got {timeout!r}.")
    self.group_size = group_size
    self.group_key = group_key
    self.device = device
    self.communication = communication
    self.timeout = float(timeout)

  def _reduce(self, flat, instance_key, merge_op="Add", group_size=None,
              group_key=None):
    with tf.device(self.device):
      return collective_ops.all_reduce_v2(
          flat,
          group_size=self.group_size if group_size is None else group_size,
          group_key=self.group_key if group_key is None else group_key,
          instance_key=instance_key, merge_op=merge_op, final_op="Id",
          communication_hint=self.communication, timeout=self.timeout)

  def weighted_sum(self, tensors, weight, role="model", group_size=None,
                   group_key=None):
    """Returns `sum over members of weight * tensors` (same structure).

    `group_size` and `group_key` may be tensors, overriding the averager's
    own, so one op serves whichever group a plan puts this member in.
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    out = list(tensors)
    previous = fault_injection.before_collective()  # [] outside tests
    for pack_index, indices in enumerate(_packs(tensors)):
      assert pack_index < _MAX_PACKS
      dtype = tensors[indices[0]].dtype
      with tf.device(self.device):
        flat = tf.concat([tf.reshape(tensors[i], [-1]) for i in indices], 0)
        flat = flat * tf.cast(weight, dtype)
      # Collectives in one function are ordered explicitly: without an
      # ordering token, two of them may be launched in different orders on
      # different members and deadlock.
      with tf.control_dependencies(previous):
        reduced = self._reduce(
            flat, instance_key(role, pack_index, dtype.name, flat.shape[0]),
            group_size=group_size, group_key=group_key)
      previous = [reduced]
      sizes = [int(np.prod(tensors[i].shape)) for i in indices]
      for i, part in zip(indices, tf.split(reduced, sizes)):
        out[i] = tf.reshape(part, tensors[i].shape)
    return out

  def min_max(self, vector, role="check"):
    """Element-wise (min, max) of a float64 vector over the members."""
    vector = tf.cast(tf.convert_to_tensor(vector), tf.float64)
    both = tf.concat([vector, -vector], 0)
    reduced = self._reduce(
        both, instance_key(role, 0, "float64", both.shape[0]), merge_op="Max")
    n = int(vector.shape[0])
    return -reduced[n:], reduced[:n]


class PerGroupAverager:
  """Picks NCCL or ring for each group at run time ("auto" on GPUs).

  A plan's groups change from round to round; a group whose members all sit
  on one host averages over NCCL, one that spans hosts over gRPC ring. The
  choice is a tensor (`use_nccl`), so both ops are built and one runs.
  """

  def __init__(self, group_size, group_key, device, timeout):
    self.nccl = GroupAverager(group_size, group_key, device, "NCCL", timeout)
    self.ring = GroupAverager(group_size, group_key, device, "RING", timeout)

  def weighted_sum(self, tensors, weight, group_size, group_key, use_nccl,
                   role="model"):
    def run(averager):
      return lambda: averager.weighted_sum(tensors, weight, role=role,
                                           group_size=group_size,
                                           group_key=group_key)
    return tf.cond(use_nccl, run(self.nccl), run(self.ring))


class HierarchicalAverager:
  """A global average over several hosts: within hosts, across, and back.

  1. Each host's members sum `weight_in_host * values` (NCCL on GPUs).
  2. One leader per host sums `host_share * host_average` with the other
     leaders over gRPC ring: only one member per host crosses the network.
  3. Each leader broadcasts the result to its host's members.
  Group keys, sizes and weights are tensors taken from the plan.
  """

  def __init__(self, device, intra_communication, timeout):
    self.intra = GroupAverager(2, 0, device, intra_communication, timeout)
    self.cross = GroupAverager(2, 0, device, "RING", timeout)

  def weighted_sum(self, tensors, p):
    """`p`: tensors host_key, host_size, weight_in_host, is_leader,
    leaders_key, leaders_size, host_share as attributes (a RoundPart of
    protocol/round_book.py)."""
    def within(values, weight, role):
      return tf.cond(
          p.host_size > 1,
          lambda: self.intra.weighted_sum(values, weight, role=role,
                                          group_size=p.host_size,
                                          group_key=p.host_key),
          lambda: [tf.identity(v) for v in values])

    host_average = within(tensors, p.weight_in_host, "model")
    crossed = tf.cond(
        p.is_leader,
        lambda: self.cross.weighted_sum(host_average, p.host_share,
                                        role="across",
                                        group_size=p.leaders_size,
                                        group_key=p.leaders_key),
        lambda: [tf.identity(v) for v in host_average])
    return within(crossed, tf.where(p.is_leader, 1.0, 0.0), "back")


def packed_bytes(tensors):
  """Bytes of the tensors one member contributes to an averaging."""
  return sum(int(np.prod(t.shape)) * t.dtype.size for t in tensors)


@contextlib.contextmanager
def peer_errors_explained(what, worker, num_workers, timeout,
                          collectives_only=False):
  """Turns a TensorFlow error of a collective at `what` into the clear one:
  PeerTimeoutError when peers did not arrive within `timeout`, else
  WorkerLostError. With `collectives_only`, errors of other ops (a user's
  input pipeline, say) pass unchanged."""
  try:
    yield
  except PEER_ERRORS as e:
    if collectives_only and "Collective" not in str(e):
      raise
    if isinstance(e, tf.errors.DeadlineExceededError):
      raise PeerTimeoutError(
          f"worker {worker}: not every one of the {num_workers} workers "
          f"reached {what} within {timeout:.0f} s (collective_timeout). A "
          "worker may have died, stalled, or stopped training earlier than "
          "the others.") from e
    raise WorkerLostError(
        f"worker {worker}: a peer is gone at {what} ({type(e).__name__}); a "
        "worker may have died or stopped training earlier than the others. "
        "This process's collectives are now aborted: restart the job (from "
        "a checkpoint; oscars-launch --restarts does this).") from e
