"""control_plane.py's numbers: the averaging traffic a plan makes, and the
medians over a run's rounds. No TensorFlow."""

import statistics

from oscars_tf.policy import plan_changes
from oscars_tf.policy import shard_layout


def averaging_traffic(plan, hosts, members, max_leaders, shard=True):
  """(mean, max) over the members of the bytes each sends to average the
  model in the round `plan` plans, over the ring all-reduce bound
  2(N-1)/N x the model's bytes: counted from the plan and the collectives
  the strategy runs (a ring all-reduce of g members sends 2(g-1)/g of the
  model per member; a global sync across hosts: a ring in each host, the
  host leaders' rings in racks, the racks' leaders' ring, back down with
  the same rings, runtime/averagers.py HierarchicalAverager; shard by
  shard where the hosts' sizes allow, runtime/sharded_sync.py;
  `shard=False`: host by host whatever the sizes)."""
  def ring(g):
    return 2.0 * (g - 1) / g if g > 1 else 0.0
  members = sorted(members)
  sent = dict.fromkeys(members, 0.0)
  by_host = {}
  for j in members:
    by_host.setdefault(hosts[j], []).append(j)
  layout = (shard_layout.shard_layout(hosts, members, max_leaders)
            if shard and plan.global_sync and len(by_host) > 1 else None)
  if layout is not None:  # runtime/sharded_sync.py
    several = len(layout.racks) > 1
    for j in members:
      place, rack, leads, h = layout.place(j)
      # the all-to-all into the host, the gather back: (L-1)/pieces each
      sent[j] += 2 * (len(layout.hosts[h]) - 1) / layout.pieces[h]
      for s in layout.segments_of(h, place):  # each segment's rack ring
        width = (layout.cuts[s + 1] - layout.cuts[s]) / layout.denominator
        g = len(layout.ring(rack, s))
        sent[j] += ring(g) * width
        if several:  # the racks' ring, the broadcast back down the rack
          sent[j] += (g - 1) / g * width  # (a tree: on average)
          if leads:
            sent[j] += ring(len(layout.racks)) * width
  elif plan.global_sync and len(by_host) > 1:
    leaders = sorted(g[0] for g in by_host.values())
    racks = plan_changes.racks_of(leaders, max_leaders)
    for g in by_host.values():
      for j in g:
        sent[j] += 2 * ring(len(g))  # into the host, and back down
    for rack in racks:
      for j in rack:  # the rack's ring (and back down from its leader)
        sent[j] += ring(len(rack)) * (2 if len(racks) > 1 else 1)
      if len(racks) > 1:
        sent[rack[0]] += ring(len(racks))
  else:
    is_member = set(members)
    for g in plan.groups:
      g = [j for j in g if j in is_member]
      for j in g:
        sent[j] += ring(len(g))
  bound = ring(len(members)) or 1.0
  values = list(sent.values())
  return sum(values) / len(values) / bound, max(values) / bound


def polls_while_waiting(wait_s, first_s, longest_s):
  """How often a reader that waits `wait_s` for the round's decision asks
  the store again: first after `first_s`, then at doubling intervals up to
  `longest_s` (membership_member.py's long poll: first_s=POLL_S,
  longest_s=LONG_POLL_S, a get and a `latest` check each time; a host
  relay member's check of `latest`: host_relay.POLL_S and POLL_MAX_S)."""
  count, at, every = 0, first_s, first_s
  while at < wait_s:
    count += 1
    every = min(2 * every, longest_s)
    at += every
  return count


def summarize(n, every_round):
  """Medians and maxima over the rounds from 2 on; round 0 and the rounds
  until every member's rate is known (no member imputed) apart."""
  rows = [r for r in every_round if r["round"] >= 2]
  unknown = [r["round"] for r in every_round if r["imputed_members"]]
  complete = max(unknown) + 1 if unknown else 0  # first round planned
                                                 # from every rate
  early = [r["utilization"] for r in every_round
           if 0 < r["round"] <= complete]

  def med(k):
    return statistics.median(r[k] for r in rows)
  return {"workers": n, "rounds": len(rows),
          "first_table_rounds": complete,
          "utilization_until_first_table": (statistics.mean(early) if early
                                            else float("nan")),
          "bytes_out_of_chief_mb_max_every_round": max(
              r["bytes_out_of_chief"] for r in every_round) / 1e6,
          "chief_cpu_ms": med("chief_cpu_ms"),
          "chief_cpu_ms_max": max(r["chief_cpu_ms"] for r in rows),
          "worker_cpu_ms": med("worker_cpu_ms"),
          "kv_ops": med("kv_ops"),
          "bytes_out_of_chief_mb": med("bytes_out_of_chief") / 1e6,
          "bytes_out_of_chief_mb_max": max(
              r["bytes_out_of_chief"] for r in rows) / 1e6,
          "decision_kb": med("decision_bytes") / 1e3,
          "first_round_mb": rows[0]["first_round_bytes"] / 1e6,
          "live_keys_max": max(r["live_keys"] for r in rows),
          "plan_ms": med("plan_ms"),
          "utilization": med("utilization"),
          "median_local_steps": med("median_local_steps"),
          # Over the measured rounds: group rounds and global syncs alike.
          "averaging_mean_over_bound": statistics.mean(
              r["averaging_mean_over_bound"] for r in rows),
          "averaging_max_over_bound": max(
              r["averaging_max_over_bound"] for r in rows),
          "averaging_global_sync_mean_over_bound": max(
              [r["averaging_mean_over_bound"] for r in rows
               if r["global_sync"]], default=float("nan")),
          "time_budget_s": med("time_budget_s"),
          "dropped": sum(r["dropped"] for r in rows),
          "rejoined": sum(r["rejoined"] for r in rows)}
