"""The planner's groups at 1,000 to 10,000 workers (issue 14 item 3).

Pure Python, no TensorFlow: a global sync over many hosts goes host by host;
no group of a round exceeds the bound; and a long run with drifting speeds
makes a bounded number of distinct collective groups.
"""

import dataclasses
import json

import numpy as np
import pytest

from oscars_tf import schedules
from oscars_tf.policy import planner
from oscars_tf.policy import records
from oscars_tf.protocol import group_keys
from oscars_tf.protocol import round_parts


def _table(rates, hosts, round_=0):
  return records.StepRateTable(tuple(
      records.TableEntry(rate=float(r), round=round_) for r in rates),
      tuple(hosts))


def _lognormal(n, seed=0, sigma=0.5):
  return 10.0 * np.exp(np.random.default_rng(seed).normal(0, sigma, n))


def test_a_global_sync_over_64_hosts_goes_host_by_host():
  """64 hosts x 16 workers: every worker's part in a global sync is its
  host's group of 16, and the hosts' leaders' group of 64 (rounds.py runs
  a RoundPart with is_global across hosts through HierarchicalAverager):
  no collective of the sync spans the 1,024 workers."""
  n, per_host = 1024, 16
  hosts = [f"host{i // per_host}" for i in range(n)]
  config = schedules.Adaptive(global_every=1, adaptive_global=False)
  p = config.plan(_table(_lognormal(n), hosts), 1)
  assert p.global_sync and p.groups == (tuple(range(n)),)
  keys = group_keys.GroupKeys(n)
  members = range(n)
  layout = round_parts.register_groups(keys, p, hosts, members)
  sound = [True] * n
  table = np.zeros(n * len(records.FIELDS))
  leaders = set()
  for me in range(n):
    part = round_parts.part_of(me, 1, p, hosts, members, sound, keys, table,
                               False, None, layout)
    assert part.is_global
    assert part.host_size == per_host and part.leaders_size == n // per_host
    assert part.is_leader == (me % per_host == 0)
    # The two steps compose to the flat weights of the plan.
    assert np.isclose(part.weight_in_host * part.host_share, p.weights[me])
    if part.is_leader:
      leaders.add(part.leaders_key)
  assert len(leaders) == 1
  # Hosts of one size: the sync goes shard by shard, shard r in a ring of
  # the 64 hosts' r-th workers (runtime/sharded_sync.py).
  assert part.sharded and part.pieces == per_host
  assert part.segment_sizes[0] == 64 and part.segment_sizes[1] == 0
  assert part.shard_rank == per_host - 1  # (the last worker's part)
  # Keys: the whole cluster, 64 hosts, their leaders, and the 16 shard
  # rings, less the first (the leaders' own).
  assert len(keys) == 1 + 64 + 1 + 15


def test_a_global_sync_over_625_hosts_adds_a_level_of_racks():
  """10,000 workers, 16 a host: 625 host leaders would make one ring of
  625; in racks of at most 64 (the default bound) the sync has three
  levels and no ring of more than 64 members, and the weights compose to
  the plan's flat weights."""
  n, per_host = 10_000, 16
  hosts = [f"host{i // per_host}" for i in range(n)]
  config = schedules.Adaptive(global_every=1, adaptive_global=False)
  p = config.plan(_table(_lognormal(n), hosts), 1)
  assert p.global_sync
  keys = group_keys.GroupKeys(n)
  layout = round_parts.register_groups(keys, p, hosts, range(n),
                                       planner.DEFAULT_MAX_GROUP_SIZE)
  sound = [True] * n
  table = np.zeros(n * len(records.FIELDS))
  parts = {me: round_parts.part_of(me, 1, p, hosts, range(n), sound, keys,
                                   table, False,
                                   planner.DEFAULT_MAX_GROUP_SIZE, layout)
           for me in range(0, n, per_host)}  # the host leaders
  racks = {part.leaders_key: part.leaders_size for part in parts.values()}
  assert len(racks) == 10 and max(racks.values()) <= 64
  assert sum(racks.values()) == 625
  tops = {(part.racks_key, part.racks_size) for part in parts.values()
          if part.is_rack_leader}
  assert len(tops) == 1 and next(iter(tops))[1] == 10
  assert sum(part.is_rack_leader for part in parts.values()) == 10
  assert sum(part.rack_share for part in parts.values()
             if part.is_rack_leader) == pytest.approx(1.0)
  # Keys: the whole cluster, 625 hosts, 10 racks, their leaders; the
  # shard rings: 16 a rack and 16 across the racks' first hosts, less the
  # first of each (the racks and the racks' leaders).
  assert len(keys) == 1 + 625 + 10 + 1 + (10 * 16 + 16 - 11)


def test_no_group_exceeds_the_default_bound_at_ten_thousand_workers():
  n = 10_000
  rates = _lognormal(n, seed=1)
  bound = planner.DEFAULT_MAX_GROUP_SIZE
  # Speed groups: 10,000 workers in one group would be a ring of 10,000.
  speed = schedules.Adaptive(grouping="speed", global_every=4).plan(
      _table(rates, [f"h{i // 16}" for i in range(n)]), 1)
  assert not speed.global_sync
  assert max(len(g) for g in speed.groups) == bound
  assert min(len(g) for g in speed.groups) >= 2  # no one averages alone
  # Host groups: a host of 200 workers (one big machine) is split.
  hosts = ["big"] * 200 + [f"h{i // 8}" for i in range(n - 200)]
  host = schedules.Adaptive(global_every=4).plan(_table(rates, hosts), 1)
  assert max(len(g) for g in host.groups) <= bound
  assert sorted(i for g in host.groups for i in g) == list(range(n))
  # An explicit bound still wins.
  small = schedules.Adaptive(grouping="speed", max_group_size=8).plan(
      _table(rates, hosts), 1)
  assert max(len(g) for g in small.groups) <= 9  # 8, a last one folded in


def _drifting_run(n, rounds, config, seed=0, per_host=16, drift=0.02):
  """Rates lognormal (sigma 0.5) whose logs drift (a mean-reverting random
  walk, `drift` per round) plus 5 % noise; yields (round, plan, keys)."""
  rng = np.random.default_rng(seed)
  hosts = [f"host{i // per_host}" for i in range(n)]
  logs = rng.normal(0, 0.5, n)
  keys, state = group_keys.GroupKeys(n), None
  for r in range(rounds):
    logs = logs * np.sqrt(1 - (drift / 0.5) ** 2) + rng.normal(0, drift, n)
    rates = 10 * np.exp(logs + rng.normal(0, 0.05, n))
    p = config.plan(_table(rates, hosts, r), r, state)
    state = p.state
    round_parts.register_groups(keys, p, hosts, range(n))
    yield r, p, keys


def test_distinct_groups_stay_bounded_while_speeds_drift():
  """1,024 workers whose speeds drift for ever: past `max_groupings`
  groupings the planner reuses the best one it made, so the collective
  groups (keys) stop growing. (Unbounded before: 2,945 distinct groups in
  1,000 rounds with groups of 16, still growing linearly.)"""
  n, limit = 1024, 4
  config = schedules.Adaptive(grouping="speed", max_group_size=16,
                              max_groupings=limit)
  seen, sizes = {}, []
  for r, p, keys in _drifting_run(n, 240, config):
    seen[r] = len(keys)
    if not p.global_sync:
      sizes.append(max(len(g) for g in p.groups))
  groupings = p.state.groupings
  assert len(groupings) == limit, len(groupings)
  # Each grouping has 64 groups; the cluster, 64 hosts and their leaders,
  # 15 more shard rings (the first is the leaders').
  assert seen[239] <= limit * n // 16 + 1 + 64 + 1 + 15, seen[239]
  first_full = min(r for r in seen if seen[r] == seen[239])
  print(f"\n{n} workers, 240 rounds: {seen[239]} group keys, the last new "
        f"one at round {first_full}; largest group {max(sizes)}")
  assert first_full < 200 and max(sizes) <= 16


def test_groupings_survive_a_rejoiners_json_copy_of_the_state():
  """A rejoining worker adopts the chief's state through JSON (lists, not
  tuples): its next plan is the members' plan, byte for byte."""
  config = schedules.Adaptive(grouping="speed", max_group_size=8,
                              max_groupings=2)
  plans = [p for _, p, _ in _drifting_run(64, 60, config, drift=0.1)]
  state = plans[-1].state
  copied = records.PlannerState.from_json(json.loads(json.dumps(
      state.to_json())))
  # The round book sends the state's fields as they are (no deep copy):
  # the JSON of a deep copy.
  deep = dataclasses.asdict(state)
  deep["rule"] = state.rule.to_json()
  assert json.dumps(state.to_json()) == json.dumps(deep)
  table = _table(_lognormal(64, seed=5), [f"h{i // 8}" for i in range(64)],
                 60)
  assert (config.plan(table, 60, copied).digest() ==
          config.plan(table, 60, state).digest())


def test_numpy_floats_hash_as_the_same_bytes_as_one_by_one():
  # A plan's rates may be numpy floats (the planner's arrays): hashed at
  # once, they must feed the digest the bytes the per-element rule feeds,
  # so every worker's digest agrees whichever float type it holds.
  import hashlib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(3)
  for _ in range(100):
    values = [float(x) for x in rng.lognormal(0, 3, int(rng.integers(1, 40)))]
    values[int(rng.integers(len(values)))] = float("nan")
    mixed = tuple(np.float64(v) if rng.random() < 0.5 else v for v in values)
    mixed = (np.float64(mixed[0]),) + mixed[1:]
    at_once, one_by_one = hashlib.sha256(), hashlib.sha256()
    records._hash_into(at_once, mixed)  # pylint: disable=protected-access
    one_by_one.update(b"(%d" % len(mixed))
    for v in mixed:
      records._hash_into(one_by_one, v)  # pylint: disable=protected-access
    one_by_one.update(b")")
    assert at_once.digest() == one_by_one.digest()
