"""A global sync across hosts, shard by shard against host by host.

    python benchmarks/global_sync.py --hosts=2 --per_host=4 --params=4700000

`--gone=7` leaves a worker out (hosts of unequal sizes); `--max_segments=1`
forces the even cut (policy/shard_layout.py) for comparison.

One process, one logical CPU device per worker and one thread each (as in
tests/test_sharded_sync.py), so the collectives are TensorFlow's real ring,
all-to-all, gather and broadcast implementations, moving buffers between
devices in memory instead of over a network. Each worker gets its part in
a global sync from round_parts.part_of (the code a worker runs at a round
end), then both averagers run on the same values, interleaved, each in a
`tf.function` as a worker runs it (the first sync of each traces it):
`runtime/sharded_sync.py` (ShardedAverager) and `runtime/averagers.py`
(HierarchicalAverager, host by host through one leader per host). Prints
the median wall time of a sync and the bytes each worker sends (counted
from the collectives, as benchmarks/control_plane_summary.py counts them),
and writes JSON. No speeds are involved: no heterogeneity, SIMULATED or
EMULATED.
"""

import json
import statistics
import threading
import time

from absl import app
from absl import flags
import numpy as np

FLAGS = flags.FLAGS
flags.DEFINE_integer("hosts", 2, "Hosts (emulated: device groups).")
flags.DEFINE_integer("per_host", 4, "Workers a host.")
flags.DEFINE_integer("params", 4_700_000, "float32 parameters in the model.")
flags.DEFINE_integer("repeats", 5, "Syncs timed per averager.")
flags.DEFINE_integer("max_hosts_a_rack", 0, "Racks of at most this many "
                     "hosts (0: one rack).")
flags.DEFINE_list("gone", [], "Workers not in the sync (e.g. 7: the first "
                  "host one short), for hosts of unequal sizes.")
flags.DEFINE_integer("max_segments", 0, "Segments a piece may cross hosts "
                     "in (0: shard_layout.MAX_SEGMENTS; 1: the even cut).")
flags.DEFINE_string("result_json", None, "Where to write the results.")


def _parts(n, hosts, members, max_leaders):
  from oscars_tf import schedules  # pylint: disable=g-import-not-at-top
  from oscars_tf.policy import plan_changes  # pylint: disable=g-import-not-at-top
  from oscars_tf.policy import records  # pylint: disable=g-import-not-at-top
  from oscars_tf.protocol import group_keys  # pylint: disable=g-import-not-at-top
  from oscars_tf.protocol import round_parts  # pylint: disable=g-import-not-at-top
  table = records.StepRateTable(tuple(
      records.TableEntry(rate=10.0, round=0) for _ in range(n)), tuple(hosts))
  plan = plan_changes.with_members(schedules.Adaptive(
      global_every=1, adaptive_global=False).plan(table, 1), members)
  keys = group_keys.GroupKeys(n)
  layout = round_parts.register_groups(keys, plan, hosts, members,
                                       max_leaders)
  return plan, {me: round_parts.part_of(me, 1, plan, hosts, members,
                                        [j in members for j in range(n)],
                                        keys, np.zeros(1), False,
                                        max_leaders, layout)
                for me in members}


def main(argv):
  del argv
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  import control_plane_summary  # pylint: disable=g-import-not-at-top
  from oscars_tf.distribute import rounds  # pylint: disable=g-import-not-at-top
  from oscars_tf.policy import shard_layout  # pylint: disable=g-import-not-at-top
  from oscars_tf.protocol import round_parts  # pylint: disable=g-import-not-at-top
  from oscars_tf.runtime import averagers as averagers_lib  # pylint: disable=g-import-not-at-top
  from oscars_tf.runtime import sharded_sync  # pylint: disable=g-import-not-at-top

  n = FLAGS.hosts * FLAGS.per_host
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * n)
  hosts = [f"h{i // FLAGS.per_host}" for i in range(n)]
  max_leaders = FLAGS.max_hosts_a_rack or None
  members = [j for j in range(n) if str(j) not in FLAGS.gone]
  if FLAGS.max_segments:
    shard_layout.MAX_SEGMENTS = FLAGS.max_segments
  plan, parts = _parts(n, hosts, members, max_leaders)
  assert all(p.sharded for p in parts.values()), "these hosts should shard"
  rng = np.random.default_rng(0)
  values = [rng.normal(size=FLAGS.params).astype(np.float32)
            for _ in range(n)]
  averagers = {
      "shard by shard": lambda d: sharded_sync.ShardedAverager(
          d, "RING", 300.0),
      "host by host": lambda d: averagers_lib.HierarchicalAverager(
          d, "RING", 300.0)}
  times = {name: [] for name in averagers}
  results = {}

  functions = {}

  def member(me, name, barrier, out):
    device = f"/device:CPU:{me}"
    with tf.device(device):
      if (me, name) not in functions:  # as a worker runs it: in a graph
        p = round_parts.RoundPart(*[
            tf.constant(v, d) for v, d in zip(parts[me], rounds.PART_DTYPES)])
        averager = averagers[name](device)
        functions[me, name] = (tf.constant(values[me]), tf.function(
            lambda x: averager.weighted_sum([x], p)[0]))
      x, fn = functions[me, name]
      barrier.wait(timeout=300)
      t0 = time.perf_counter()
      got = fn(x).numpy()
      out[me] = (time.perf_counter() - t0, got[:4].tolist())

  for repeat in range(FLAGS.repeats + 1):  # the first of each: tracing
    for name in averagers:
      out, barrier = {}, threading.Barrier(len(members))
      threads = [threading.Thread(target=member, args=(m, name, barrier, out))
                 for m in members]
      for t in threads:
        t.start()
      for t in threads:
        t.join(timeout=600)
      assert len(out) == len(members), (
          f"{name}: {len(members) - len(out)} workers failed")
      if repeat:
        times[name].append(max(v[0] for v in out.values()))
      results[name] = out[members[0]][1]
  expected = sum(plan.weights[j] * values[j][:4] for j in members)
  sent = {}
  for name in averagers:
    np.testing.assert_allclose(results[name], expected, rtol=1e-4,
                               atol=1e-5)
  # Bytes a worker sends over the ring bound, counted from the collectives
  # each averager runs (control_plane_summary).
  sent["shard by shard"] = control_plane_summary.averaging_traffic(
      plan, hosts, members, max_leaders or FLAGS.hosts)
  sent["host by host"] = control_plane_summary.averaging_traffic(
      plan, hosts, members, max_leaders or FLAGS.hosts, shard=False)
  m = len(members)
  bound_mb = 2 * (m - 1) / m * FLAGS.params * 4 / 1e6
  rows = []
  gone = f" less workers {','.join(FLAGS.gone)}" if FLAGS.gone else ""
  if FLAGS.max_segments == 1:
    gone += " (the even cut)"
  print(f"Global sync, {FLAGS.hosts} hosts x {FLAGS.per_host} workers{gone}, "
        f"{FLAGS.params:,} float32 parameters (ring bound {bound_mb:.1f} MB "
        "a worker); in-process: logical CPU devices, no network; no "
        "heterogeneity")
  print(f"{'averager':<16} {'median s':>9} {'min s':>7} {'max s':>7} "
        f"{'MB/worker mean (max)':>21} {'x bound mean (max)':>19}")
  for name in averagers:
    mean, most = sent[name]
    row = {"averager": name, "median_s": statistics.median(times[name]),
           "min_s": min(times[name]), "max_s": max(times[name]),
           "sent_mean_over_bound": mean, "sent_max_over_bound": most,
           "sent_mb_mean": mean * bound_mb, "sent_mb_max": most * bound_mb}
    rows.append(row)
    print(f"{name:<16} {row['median_s']:>9.3f} {row['min_s']:>7.3f} "
          f"{row['max_s']:>7.3f} {row['sent_mb_mean']:>12.1f} "
          f"({row['sent_mb_max']:.1f}) {mean:>12.2f} ({most:.2f})")
  ratio = rows[1]["median_s"] / rows[0]["median_s"]
  print(f"host by host / shard by shard, median time: {ratio:.2f}x")
  if FLAGS.result_json:
    with open(FLAGS.result_json, "w") as f:
      json.dump({"transport": "in-process", "heterogeneity": "none",
                 "flags": {k: FLAGS[k].value for k in (
                     "hosts", "per_host", "params", "repeats",
                     "max_hosts_a_rack", "gone", "max_segments")},
                 "results": rows, "time_ratio": ratio}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
