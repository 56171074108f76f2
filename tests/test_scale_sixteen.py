"""Issue 14 item 4: sixteen real worker processes, two hosts, one death.

16 workers (digits MLP) over real gRPC on loopback under `Adaptive()` with
`grouping="speed"`. Workers 0-7 have addresses on 127.0.0.1 and 8-15 on
127.0.0.2: two EMULATED hosts (the planner and the hierarchical global sync
see two hosts; the bytes still go over one loopback). Step times are
SIMULATED: a sleep of 20 ms per step on fast workers and 80 ms (4x) on slow
ones, added to real compute. Each host holds fast and slow workers, and
unevenly (6 fast on the first, 2 on the second), so a speed group of 4 must
cross the hosts: with 4 fast on each (an even/odd layout) grouping by host
and by speed can give the same groups, and whether one crossed was chance
(a CI run's speed groups all stayed on their host). An endless tf.data
stream, 200 steps per worker per epoch (3,200 over the cluster), makes
epochs of several rounds (the last round of an epoch is a global sync).
`max_group_size=4` (16 workers in one speed group would average globally
every round: nothing to check). Worker 6
(fast, host 127.0.0.1, not its host's leader) kills itself with SIGKILL in
the middle of a round of epoch 1 (tests/worker_programs.py
`_die_mid_round`), as `kill -9` would.

Every wait is bounded: the job has a wall-clock limit, then every process
group is killed (multiworker.run).
"""

import os

import numpy as np
import pytest

import multiworker

pytestmark = pytest.mark.timeout(660)

NUM_WORKERS = 16
HOSTS = ["127.0.0.1"] * 8 + ["127.0.0.2"] * 8
# 4x. Fast: 0, 2, 3, 4, 6, 7 on the first host, 8 and 12 on the second.
SLOW = frozenset((1, 5, 9, 10, 11, 13, 14, 15))
PROFILE = "20ms*" + ",".join("4" if i in SLOW else "1"
                             for i in range(NUM_WORKERS))
VICTIM = 6
SURVIVORS = [i for i in range(NUM_WORKERS) if i != VICTIM]
EPOCHS = 2
JOB_TIMEOUT_S = 540  # ~3 min alone on 2 cores; far longer beside another job


@pytest.fixture(scope="module")
def job():
  return multiworker.run(
      "fit", NUM_WORKERS, {
          "simulate": PROFILE, "epochs": EPOCHS, "dataset_steps": 200,
          "optimizer": "adam", "lr": 0.005,
          # Generous: 16 processes share 2 cores. The dead worker is dropped
          # when its server refuses the chief's probe, not after these.
          "timeout": 120, "straggler_timeout": 60, "record": True,
          "adaptive": {"grouping": "speed", "max_group_size": 4},
          "die_mid_round": [VICTIM, 1]},
      timeout=JOB_TIMEOUT_S, hosts=HOSTS, kill_on_failure=False,
      expect_success=False)


def test_the_job_ends_by_itself_without_the_dead_worker(job):
  assert job.failed is None, f"{job.failed}:\n{job.tail()}"
  assert job.codes[VICTIM] == -9, (job.codes, job.tail())
  assert all(job.codes[i] == 0 for i in SURVIVORS), (job.codes, job.tail())
  assert os.path.exists(os.path.join(job.outdir, f"died_{VICTIM}"))
  assert job.outputs[VICTIM] is None
  assert all(job.outputs[i] and "weights" in job.outputs[i]
             for i in SURVIVORS), job.tail()


def test_the_survivors_agree(job):
  outs = [job.outputs[i] for i in SURVIVORS]
  # One plan per round on all of them (digests by round number: every
  # survivor took part in every round).
  plans = [{r["round"]: r["plan"] for r in o["rounds"]} for o in outs]
  assert all(p == plans[0] for p in plans), "survivors' plans differ"
  assert all(o["rounds"][-1]["members"] == SURVIVORS for o in outs)
  # The epoch's last round is a global sync: identical models after it.
  weights = [np.asarray(o["weights"]) for o in outs]
  assert all(np.max(np.abs(w - weights[0])) <= 1e-6 for w in weights)
  assert len({o["test_accuracy"] for o in outs}) == 1
  assert all(o["epochs_run"] == EPOCHS for o in outs)


def test_a_sync_of_both_whole_hosts_goes_shard_by_shard(job):
  """A global sync goes shard by shard (runtime/sharded_sync.py): each host
  in 8 pieces while both hold 8 workers; after the death (worker 6) the
  first host cuts 7 and the pieces cross hosts as 14 segments (a fitted
  cut, policy/shard_layout.py); every worker holds the same model after
  each. TensorFlow does not rank the second host's members
  (tasks 8 to 15) in task order: without the rank order the sync gathers
  first, the rings paired members holding different shards and the two
  hosts' models differed by up to 20 after the sync (measured)."""
  outs = [job.outputs[i] for i in SURVIVORS]
  proj = [{r["step"]: np.asarray(r["proj"]) for r in o["records"]}
          for o in outs]
  checked = set()
  for k, r in enumerate(outs[0]["rounds"]):
    if not r["sharded_sync"]:
      assert not r["global_sync"] or len(r["members"]) != NUM_WORKERS, k
      continue
    ends = [o["rounds"][k]["end_step"] for o in outs]
    if all(e in p for e, p in zip(ends, proj)):
      after = [p[e] for e, p in zip(ends, proj)]
      assert all(np.max(np.abs(a - after[0])) <= 1e-5 for a in after), (
          k, [float(np.max(np.abs(a - after[0]))) for a in after])
      checked.add(len(r["members"]))
  assert checked == {NUM_WORKERS, NUM_WORKERS - 1}, [
      (r["round"], r["global_sync"], r["sharded_sync"], len(r["members"]))
      for r in outs[0]["rounds"]]


def test_the_dead_worker_is_dropped_once_and_never_back(job):
  chief = job.outputs[0]["rounds"]
  drops = [r["round"] for r in chief if VICTIM in r["dropped"]]
  assert len(drops) == 1, [(r["round"], r["dropped"]) for r in chief]
  assert not any(r["dropped"] for r in chief if r["round"] != drops[0])
  assert not any(VICTIM in r["rejoined"] for r in chief)
  assert all(VICTIM not in r["members"] for r in chief
             if r["round"] >= drops[0])
  for i in SURVIVORS:
    assert [r["round"] for r in job.outputs[i]["rounds"]
            if VICTIM in r["dropped"]] == drops, i


def test_groups_follow_speed_not_hosts(job):
  """In every round planned from a table whose measured rates separate the
  fast workers from the slow ones, each group the planner made afresh
  holds one kind only (after the death, 7 fast workers in groups of 4
  share one group with a slow one at most), and at most four; some groups
  cross the two hosts (the second host's 2 fast workers cannot fill a
  group of 4 alone).

  Groups the planner kept from the round before are not held to that: it
  keeps them while a regroup would not narrow them by REGROUP_GAIN
  (planner.stable_groups), and a fast worker measured slow in round 0 (its
  first step beside 15 others tracing) can leave mixed groups that a
  barely separated table does not undo (a CI run: worker 12 at 11.6 steps/s
  against the slow ones' 10.5). A planner grouping by host would make no
  fresh speed-only grouping at all."""
  chief = job.outputs[0]["rounds"]
  checked, fresh, crossing = 0, 0, 0
  last_groups = None  # of the last round that was not a global sync
  for before, r in zip(chief, chief[1:]):
    if r["global_sync"]:
      continue
    kept, last_groups = r["groups"] == last_groups, r["groups"]
    if "table_rates" not in before:
      continue
    rates = before["table_rates"]
    fast = [rates[i] for i in before["members"] if i not in SLOW]
    slow = [rates[i] for i in before["members"] if i in SLOW]
    if not (fast and slow and min(fast) > max(slow)):
      continue  # rates not yet (or not clearly) measured
    checked += 1
    assert max(len(g) for g in r["groups"]) <= 4, (r["round"], r["groups"])
    crossing += sum(len({HOSTS[i] for i in g}) > 1 for g in r["groups"])
    if kept:
      continue
    fresh += 1
    mixed = [g for g in r["groups"] if len({i in SLOW for i in g}) > 1]
    assert len(mixed) <= (0 if VICTIM in r["members"] else 1), (
        r["round"], r["groups"], rates)
  print(f"\n16 workers: {len(chief)} rounds, {checked} speed-grouped rounds "
        f"checked ({fresh} grouped afresh), {crossing} groups across the two "
        "hosts")
  assert checked >= 2 and fresh >= 1 and crossing >= 1, [
      (r["round"], r["global_sync"], r["groups"]) for r in chief]
