"""Tests for the sharded global sync: shard_layout.shard_layout (its rings)
and runtime/sharded_sync.py (its sums, run on logical CPUs).

The sums run in a child process: it needs six logical CPUs, and this
process's TensorFlow runtime has two (conftest.py). Each member is a thread
on its own logical CPU, with its RoundPart from round_parts.part_of, as a
worker gets it at a round end.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import control_plane_summary
from oscars_tf import schedules
from oscars_tf.policy import plan_changes
from oscars_tf.policy import records
from oscars_tf.policy import shard_layout


def _hosts(*sizes):
  return [f"h{h}" for h, size in enumerate(sizes) for _ in range(size)]


def test_equal_hosts_shard_and_every_ring_is_bounded():
  hosts = _hosts(*[4] * 10)  # 10 hosts of 4; racks of at most 3 hosts
  layout = shard_layout.shard_layout(hosts, range(40), max_leaders=3)
  assert len(layout.hosts) == 10 and len(layout.racks) == 4
  assert layout.pieces == (4,) * 10 and layout.segments == 4
  rings = layout.rings()
  assert max(len(r) for r in rings) <= 4  # 3 hosts a rack, 4 racks' tops
  # Every member is in exactly one rack ring, with the same rank on every
  # host of the ring.
  in_rack_rings = rings[:4 * 4]
  assert sorted(j for r in in_rack_rings for j in r) == list(range(40))
  for ring in in_rack_rings:
    assert len({j % 4 for j in ring}) == 1
  for me in range(40):
    rank, rack, leads, h = layout.place(me)
    assert rank == me % 4 and h == me // 4
    assert list(layout.segments_of(h, rank)) == [rank]
    assert me in layout.ring(rack, rank)
    assert leads == (h == layout.racks[rack][0])
    assert layout.top(rank)[rack] // 4 == layout.racks[rack][0]


@pytest.mark.parametrize("hosts, members", [
    (_hosts(2, 2, 1), range(5)),      # a host of one member
    (_hosts(2, 2), [0, 1, 2]),        # a member gone: a host of one
    (_hosts(2, 4), range(6)),         # 4 >= 2 x 2: by leaders is cheaper
    (_hosts(1, 1, 1), range(3)),      # one worker a host: leaders only
    (_hosts(4), range(4)),            # one host
])
def test_no_layout_where_hosts_differ_much_or_nothing_crosses(hosts,
                                                               members):
  assert shard_layout.shard_layout(hosts, members) is None


def test_hosts_of_two_sizes_cut_to_fit_each():
  """Hosts of 3 and 2: each cuts its own pieces (thirds, halves), and the
  pieces cross hosts as the 4 segments both cuts make."""
  layout = shard_layout.shard_layout(_hosts(3, 3), [0, 1, 2, 3, 5])
  assert layout.hosts == ((0, 1, 2), (3, 5)) and layout.pieces == (3, 2)
  assert (layout.denominator, layout.cuts) == (6, (0, 2, 3, 4, 6))
  assert layout.rings() == [(0, 3), (1, 3), (1, 5), (2, 5)]
  assert layout.place(2) == (2, 0, True, 0)  # holds the last third
  assert list(layout.segments_of(0, 2)) == [3]
  assert list(layout.segments_of(1, 0)) == [0, 1]  # worker 3: 2 segments
  assert shard_layout.shard_layout(_hosts(3, 3), [0, 1, 3, 4]).rings() == [
      (0, 3), (1, 4)]


@pytest.mark.parametrize("sizes", [
    (8, 8, 8, 6), (8, 7, 6, 8), (8, 7, 5), (4, 3, 3),
    (8, 7, 6, 5, 8)])  # (the last: too many segments, the even cut)
def test_every_segment_has_one_holder_a_host_and_pieces_are_covered(sizes):
  hosts = _hosts(*sizes)
  layout = shard_layout.shard_layout(hosts, range(len(hosts)),
                                     max_leaders=2)
  for h, members in enumerate(layout.hosts):
    held = [s for place in range(len(members))
            for s in layout.segments_of(h, place)]
    assert held == list(range(layout.segments))  # each once, in order
    assert max(len(layout.segments_of(h, place))
               for place in range(len(members))) <= (
                   shard_layout.MAX_SEGMENTS)
  for s in range(layout.segments):
    for k in range(len(layout.racks)):
      for j in layout.ring(k, s):
        place, rack, _, h = layout.place(j)
        assert rack == k and s in layout.segments_of(h, place)


def test_many_sizes_fall_back_to_the_even_cut():
  """9 host sizes would cut a piece into more than MAX_SEGMENTS segments:
  every host cuts as the smallest, and a larger host's members past it
  hold nothing. So do sizes whose cut points need too fine a
  denominator."""
  layout = shard_layout.shard_layout(_hosts(*range(9, 18)), range(117))
  assert layout.pieces == (9,) * 9 and layout.cuts == tuple(range(10))
  assert list(layout.segments_of(8, 16)) == []  # the host of 17's last
  fitted = shard_layout.shard_layout(_hosts(8, 7, 5), range(20))
  assert fitted.pieces == (8, 7, 5) and fitted.denominator == 280
  # two sizes (2 segments a piece at most) but cut points in 65,792ths
  fine = shard_layout.shard_layout(_hosts(257, 256), range(513))
  assert fine.pieces == (256, 256) and fine.denominator == 256


@pytest.mark.parametrize("sizes, members_gone", [
    ((8, 8, 8, 8), (30, 31)),         # a host of 6 among hosts of 8
    ((8,) * 16, (3, 40, 41, 77)),     # hosts of 7 and 6 among 8s
])
def test_a_fault_round_sends_within_the_ring_bound(sizes, members_gone):
  """The most-sending member of a global sync sends within 1.2x of the
  ring all-reduce bound 2(N-1)/N, hosts of unequal sizes included."""
  hosts = _hosts(*sizes)
  members = [j for j in range(len(hosts)) if j not in members_gone]
  plan = schedules.Adaptive(global_every=1, adaptive_global=False).plan(
      records.StepRateTable(tuple(records.TableEntry(rate=1.0, round=0)
                                  for _ in hosts), tuple(hosts)), 1)
  plan = plan_changes.with_members(plan, members)
  mean, most = control_plane_summary.averaging_traffic(
      plan, hosts, members, max_leaders=4)
  assert most <= 1.2 and mean <= most, (mean, most)


_CASES = {
    # name: (workers a host, hosts, max hosts a rack, averaging dtype,
    #        workers gone[, a sum of all first[, MAX_SEGMENTS]])
    "two_hosts_of_three": (3, 2, None, None, ()),
    "three_hosts_in_two_racks": (2, 3, 2, None, ()),
    "bfloat16": (2, 2, None, "bfloat16", ()),
    # hosts of 3, 2 and 3 members, cut in thirds and halves: worker 3's
    # half crosses as two segments, in two racks
    "a_worker_gone": (3, 3, 2, None, (4,)),
    # the same, after a sum of all 9 in thirds: groups that stay (the
    # first host, the ring of workers 0 and 3) now carry other shapes
    "a_worker_gone_after_a_whole_sum": (3, 3, 2, None, (4,), True),
    # the same where a piece may cross in one segment only: the even cut,
    # in halves; workers 2 and 8 hold nothing
    "a_worker_gone_even_cut": (3, 3, 2, None, (4,), False, 1),
}


def _child(case):
  """Runs one sharded sum with every member a thread; prints JSON."""
  import threading  # pylint: disable=g-import-not-at-top

  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from oscars_tf import schedules  # pylint: disable=g-import-not-at-top
  from oscars_tf.distribute import rounds  # pylint: disable=g-import-not-at-top
  from oscars_tf.policy import records  # pylint: disable=g-import-not-at-top
  from oscars_tf.protocol import group_keys  # pylint: disable=g-import-not-at-top
  from oscars_tf.protocol import round_parts  # pylint: disable=g-import-not-at-top
  from oscars_tf.runtime import sharded_sync  # pylint: disable=g-import-not-at-top

  per_host, num_hosts, max_leaders, dtype, gone = _CASES[case][:5]
  whole_first, max_segments = (_CASES[case][5:] + (False, None))[:2]
  if max_segments:
    shard_layout.MAX_SEGMENTS = max_segments
  n = per_host * num_hosts
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * n)
  hosts = _hosts(*[per_host] * num_hosts)
  rng = np.random.default_rng(3)
  rates = 10.0 * np.exp(rng.normal(0, 0.5, n))
  table = records.StepRateTable(tuple(
      records.TableEntry(rate=float(r), round=0) for r in rates), tuple(hosts))
  whole_plan = schedules.Adaptive(global_every=1, adaptive_global=False).plan(
      table, 1)
  keys = group_keys.GroupKeys(n)
  # 7 weights and a bias of 3: lengths not a multiple of the host's size.
  values = [[rng.normal(size=(7,)).astype(np.float32),
             rng.normal(size=(3,)).astype(np.float32)] for _ in range(n)]

  def sum_once(members):
    plan = plan_changes.with_members(whole_plan, members)
    layout = round_parts.register_groups(keys, plan, hosts, members,
                                         max_leaders)
    results, errors = {}, []

    def member(me):
      try:
        part = round_parts.part_of(me, 1, plan, hosts, members, [True] * n,
                                   keys, np.zeros(1), False, max_leaders,
                                   layout)
        sizes = [sum(hosts[j] == h for j in members) for h in set(hosts)]
        assert part.sharded and part.pieces == (
            min(sizes) if max_segments else
            sum(hosts[j] == hosts[me] for j in members)), part
        p = round_parts.RoundPart(*[
            tf.constant(v, d) for v, d in zip(part, rounds.PART_DTYPES)])
        # TensorFlow ranks a group's members in its own order (see
        # ShardedAverager): here by device, and the devices of even hosts
        # go in the reverse of worker order, those of odd hosts in it.
        host, place = divmod(me, per_host)
        device = "/device:CPU:%d" % (host * per_host + (
            per_host - 1 - place if host % 2 == 0 else place))
        averager = sharded_sync.ShardedAverager(
            device, "RING", 60.0,
            None if dtype is None else tf.as_dtype(dtype))
        # As a worker runs it: in a graph, where every branch is built.
        fn = tf.function(lambda xs: averager.weighted_sum(xs, p))  # pylint: disable=cell-var-from-loop
        with tf.device(device):
          results[me] = [t.numpy().tolist() for t in fn(
              [tf.constant(v) for v in values[me]])]
      except Exception as e:  # pylint: disable=broad-except
        errors.append(f"{type(e).__name__}: {str(e)[-500:]}")

    threads = [threading.Thread(target=member, args=(m,)) for m in members]
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=120)
    expected = [sum(plan.weights[j] * values[j][i] for j in members)
                for i in range(2)]
    return {"errors": errors, "alive": sum(t.is_alive() for t in threads),
            "results": {str(k): v for k, v in results.items()},
            "expected": [e.tolist() for e in expected],
            "weights_sum": float(sum(plan.weights[j] for j in members))}

  if whole_first:
    out = sum_once(list(range(n)))
    assert not out["errors"] and not out["alive"], out
  print(json.dumps(sum_once([j for j in range(n) if j not in gone])))


@pytest.mark.parametrize("case", sorted(_CASES))
def test_sharded_sum_is_the_weighted_average_on_every_member(case):
  # PYTHONPATH as conftest set it (the startup hook first), then this path.
  path = os.pathsep.join([os.environ["PYTHONPATH"]] + sys.path)
  env = dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES="",
             TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), case],
                        capture_output=True, text=True, timeout=300,
                        env=env, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert not out["errors"] and out["alive"] == 0, out["errors"]
  per_host, num_hosts, _, dtype, gone = _CASES[case][:5]
  assert len(out["results"]) == per_host * num_hosts - len(gone)
  assert out["weights_sum"] == pytest.approx(1.0)
  first = out["results"]["0"]
  tolerance = 2e-2 if dtype else 1e-6
  for got in out["results"].values():
    assert got == first  # bit-identical on every member
    for g, e in zip(got, out["expected"]):
      np.testing.assert_allclose(g, e, rtol=tolerance, atol=tolerance)


if __name__ == "__main__":
  _child(sys.argv[1])


def test_on_gpus_the_host_steps_are_nccl_and_the_rings_grpc():
  """Traced only (NCCL cannot run here): within the host the all-to-all,
  the rank order and the gather carry the NCCL hint; the rings and the
  broadcast across hosts go over gRPC ring."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from oscars_tf.distribute import rounds  # pylint: disable=g-import-not-at-top
  from oscars_tf.protocol import round_parts  # pylint: disable=g-import-not-at-top
  from oscars_tf.runtime import sharded_sync  # pylint: disable=g-import-not-at-top
  fields = dict.fromkeys(round_parts.RoundPart._fields, 1)
  for name, length in round_parts.VECTOR_LENGTHS.items():
    fields[name] = [0] * length
  fields.update(table=[0.0], host_size=2, pieces=2, shard_rank=0,
                cut_denominator=2,
                segment_cuts=[0] + [1] * shard_layout.MAX_SEGMENTS,
                segment_sizes=[2] + [0] * (shard_layout.MAX_SEGMENTS - 1),
                shard_racks_size=2,
                weight_in_host=0.5, host_share=0.5, rack_share=1.0)
  dtypes = rounds.PART_DTYPES._asdict()
  part = round_parts.RoundPart(**{
      k: tf.constant(bool(v) if dtypes[k] == tf.bool else v, dtypes[k])
      for k, v in fields.items()})
  averager = sharded_sync.ShardedAverager("/device:GPU:0", "NCCL", 9.0,
                                          averaging_dtype=tf.bfloat16)
  graph = tf.function(lambda: averager.weighted_sum(
      [tf.ones([5]), tf.ones([3])], part)).get_concrete_function().graph
  hints = {}
  nodes = [n for f in graph.as_graph_def().library.function
           for n in f.node_def] + list(graph.as_graph_def().node)
  for node in nodes:
    if node.op.startswith("Collective"):
      hints.setdefault(node.op, set()).add(
          node.attr["communication_hint"].s.decode())
  assert hints == {"CollectiveAllToAllV2": {"nccl"},
                   "CollectiveGatherV2": {"nccl"},
                   "CollectiveReduceV2": {"ring"},
                   "CollectiveBcastSendV2": {"ring"},
                   "CollectiveBcastRecvV2": {"ring"}}, hints
