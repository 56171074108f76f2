"""What real_workloads.py and local_adam.py read from language-model runs:
loss curves in validation bits per byte (lower is better), how the rounds
ended, gaps between paired runs. Pure functions; no TensorFlow."""

import collections


def points(result):
  """[(training time s, validation bits per byte)] at each epoch end."""
  return [(c["train_time_s"], c["val_bits_per_byte"])
          for c in result["curve"]]


def at_time(curve, t):
  """The curve's value at training time `t`, linear between epoch ends;
  None before the first point or after the last."""
  previous = None
  for time_s, value in curve:
    if time_s >= t:
      if previous is None:
        return value if time_s == t else None
      t0, v0 = previous
      return v0 + (value - v0) * (t - t0) / (time_s - t0)
    previous = (time_s, value)
  return None


def time_to(curve, target):
  """Training time at which the curve first falls to `target` (linear
  between epoch ends, as accuracy_runs.time_to_target); None if never."""
  previous = None
  for time_s, value in curve:
    if value <= target:
      if previous is None:
        return time_s
      t0, v0 = previous
      return t0 + (time_s - t0) * (v0 - target) / (v0 - value)
    previous = (time_s, value)
  return None


def target_of(reference, fraction):
  """The target: the reference curve's value at `fraction` of its training
  time (so that it reaches it at that fraction of its run)."""
  end = reference[-1][0]
  value = at_time(reference, fraction * end)
  return reference[-1][1] if value is None else value


def period_histogram(result):
  """{steps of the fastest worker in a round: rounds} over the chief's
  plans, in powers of two ("8-15": 12 rounds)."""
  counts = collections.Counter()
  for planned in result.get("round_plans") or []:
    if planned:
      k = max(planned)
      low = 1 << max(k.bit_length() - 1, 0)
      counts[f"{low}-{2 * low - 1}" if low > 1 else "1"] += 1
  return dict(sorted(counts.items(), key=lambda kv: int(
      kv[0].split("-")[0])))


def round_ends(result):
  """(averagings, how many ended at an epoch end) in the chief's rounds.
  A round in which the chief was alone in its group (a worker alone on its
  host, between global syncs: the slow-link profiles put each worker on a
  host of its own) averaged nothing, and is not counted."""
  rounds = result.get("rounds") or []
  groups = result.get("round_groups") or [None] * len(rounds)
  averaged = [r for r, g in zip(rounds, groups) if [0] not in (g or [])]
  return len(averaged), sum(1 for r in averaged if r.get("epoch_end"))


def compute_ideal(limits):
  """The speed-up over synchronous training that compute alone allows:
  sum of rates / (N * the slowest rate), rates as the CPU limits."""
  return sum(limits) / (len(limits) * min(limits))


def paired_gaps(rows):
  """{period: [gap per seed, in seed order]} of local_adam.py's rows: each
  local run's bits per byte relative to the sync run of its seed (0.01: 1 %
  worse); a local run without its seed's sync run has no gap."""
  sync = {r["seed"]: r["bpb"] for r in rows if r["run"] == "sync"}
  gaps = {}
  for r in sorted(rows, key=lambda r: r["seed"]):
    if r["run"] == "local" and r["seed"] in sync:
      gaps.setdefault(r["period"], []).append(r["bpb"] / sync[r["seed"]] - 1)
  return gaps
