"""A worker's own devices: naming them, and their copies of a variable.

Within a worker the replicas train in lockstep as in `MirroredStrategy`
(mirrored) or, with `local_replicas="local_sgd"`, each on its own gradient
until the next averaging point (`LocalSGDReplicas`).
"""

import tensorflow as tf
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.framework import func_graph
from tensorflow.python.ops import control_flow_util_v2

LOCAL_REPLICAS = ("mirrored", "local_sgd")


def inside_while_loop():
  """Whether the function being traced runs inside a tf.while_loop."""
  graph = tf.compat.v1.get_default_graph()
  while isinstance(graph, func_graph.FuncGraph):
    if isinstance(graph, control_flow_util_v2.WhileBodyFuncGraph):
      return True
    graph = graph.outer_graph
  return False


def resolve_devices(devices, info):
  """Full names of this worker's replica devices, validated."""
  local = []
  for d in tf.config.list_logical_devices():
    spec = tf.DeviceSpec.from_string(d.name)
    local.append((spec.device_type, spec.device_index))
  prefix = (info.device_prefix() if info.is_multi_worker
            else "/job:localhost/replica:0/task:0")
  if devices is None:
    chosen = [d for d in local if d[0] == "GPU"] or [("CPU", 0)]
  elif isinstance(devices, str) or not devices:
    raise ValueError("`devices` must be a non-empty list such as "
                     f"['CPU:0', 'CPU:1'], got {devices!r}.")
  else:
    chosen = []
    for d in devices:
      text = d if str(d).startswith("/") else "/device:" + str(d)
      try:
        spec = tf.DeviceSpec.from_string(text)
      except ValueError:
        spec = None
      if spec is None or spec.device_type is None or spec.device_index is None:
        raise ValueError(f"`devices`: {d!r} is not a device name like 'GPU:0'.")
      key = (spec.device_type.upper(), spec.device_index)
      if key not in local:
        raise ValueError(
            f"`devices`: {d!r} is not a device of this worker; its devices "
            f"are {['%s:%d' % k for k in local]}.")
      if key in chosen:
        raise ValueError(f"`devices` lists a device twice: {devices!r}.")
      chosen.append(key)
  return tuple("%s/device:%s:%d" % (prefix, t, i) for t, i in chosen)


def component_variables(var):
  """The per-device variables behind a (Keras or distributed) variable."""
  var = getattr(var, "_value", var)  # keras.Variable wraps a tf.Variable
  if isinstance(var, values_lib.DistributedVariable):
    return list(var.values)
  return [var]


def is_float(var):
  """Whether `var` is a floating-point variable; False for what is not a
  variable at all (tf_keras lists a lookup table's TrackableWeightHandler,
  e.g. TextVectorization's vocabulary, among a model's weights)."""
  dtype = getattr(component_variables(var)[0], "dtype", None)
  return isinstance(dtype, tf.dtypes.DType) and dtype.is_floating


def read_values(variables, local_sgd):
  """This worker's value of each variable: its replicas' mean under local
  SGD (their copies differ), else the first copy (they are equal)."""
  if local_sgd:
    return [tf.add_n([tf.identity(c) for c in component_variables(v)]) /
            len(component_variables(v)) for v in variables]
  return [tf.identity(component_variables(v)[0]) for v in variables]


def write_values(variables, values, starts=None):
  """Assigns `values` to every local copy (and to the FedNova `starts`)."""
  ops = [c.assign(a) for v, a in zip(variables, values)
         for c in component_variables(v)]
  ops += [s.assign(a) for s, a in zip(starts or [], values)]
  return tf.group(ops)


class LocalSGDReplicas:
  """Mixin for the extended: replica-context reductions stay per replica.

  Active when `self._local_sgd`; otherwise defers to MirroredStrategy.
  """

  def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
    # With local_replicas="local_sgd" the gradient all-reduce Keras and
    # custom loops do in replica context must leave each replica its own
    # gradient: SUM returns the replica's value times the replica count
    # (undoing the 1/num_replicas loss scaling), MEAN returns it unchanged.
    if not self._local_sgd:
      return super()._batch_reduce_to(reduce_op, value_destination_pairs,
                                      options)
    scale = (float(self._num_replicas_in_sync)
             if reduce_op == tf.distribute.ReduceOp.SUM else 1.0)
    out = []
    for value, _ in value_destination_pairs:
      parts = self._local_results(value)
      out.append(values_lib.PerReplica(tuple(
          tf.identity(p) * tf.cast(scale, p.dtype) for p in parts)))
    return out

  def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
    if not self._local_sgd:
      return super()._replica_ctx_all_reduce(reduce_op, value, options)
    scale = (float(self._num_replicas_in_sync)
             if reduce_op == tf.distribute.ReduceOp.SUM else 1.0)
    return tf.nest.map_structure(lambda v: v * tf.cast(scale, v.dtype), value)
