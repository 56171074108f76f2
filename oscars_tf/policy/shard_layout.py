"""The rings of a global sync done shard by shard (runtime/sharded_sync.py).
Pure Python.

Each host cuts the model into pieces, one a member: a reduce-scatter within
the host leaves each member the host's sum of its piece. Hosts of unequal
sizes cut at different points, so a piece crosses hosts as segments: the
cut points of every host together cut the model into segments, each held
by one member on every host, and each segment crosses hosts in a ring of
its holders (per rack, then the racks' first hosts). Every member then
sends about 2(N-1)/N of the model, as one flat ring would, whatever the
hosts' sizes (a fitted cut). Where a piece would cross in more than
MAX_SEGMENTS rings, or the cut points need too fine a denominator, every
host cuts as the smallest does instead (an even cut): one segment a piece,
and the members of a larger host past the smallest's size hold none.
"""

import bisect
import dataclasses
import functools
import math
from typing import Tuple

from oscars_tf.policy.plan_changes import racks_of

# The most rings one member's piece crosses hosts in: the graph has this
# many slots (runtime/sharded_sync.py), each traced. Hosts of two sizes
# within 2x of each other (hosts of 8 after a death) always fit, of three
# sizes mostly.
MAX_SEGMENTS = 4
# Cut points are fractions of the model over one denominator; the graph
# pads the model to a multiple of it (fewer than this many zeros).
_MAX_DENOMINATOR = 1 << 16


@dataclasses.dataclass(frozen=True)
class ShardLayout:
  """Segment s is [cuts[s], cuts[s+1]) / denominator of the model; host h
  cuts `pieces[h]` pieces, piece i [i/pieces[h], (i+1)/pieces[h]) held by
  its i-th member (in worker order)."""
  hosts: Tuple[Tuple[int, ...], ...]  # each host's members, by first member
  racks: Tuple[Tuple[int, ...], ...]  # indices into `hosts`, rack by rack
  pieces: Tuple[int, ...]             # pieces each host cuts
  denominator: int
  cuts: Tuple[int, ...]               # 0, ..., denominator

  @property
  def segments(self):
    return len(self.cuts) - 1

  def holder(self, h, s):
    """The member of host `h` that holds segment `s`."""
    return self.hosts[h][self.cuts[s] * self.pieces[h] // self.denominator]

  def ring(self, rack, s):
    """Segment `s`'s ring among the hosts of rack `rack`."""
    return tuple(self.holder(h, s) for h in self.racks[rack])

  def top(self, s):
    """Segment `s`'s ring of the racks' first hosts."""
    return tuple(self.holder(r[0], s) for r in self.racks)

  def rings(self):
    """Every ring of the layout, in one order for every member."""
    rings = [self.ring(k, s) for k in range(len(self.racks))
             for s in range(self.segments)]
    if len(self.racks) > 1:
      rings += [self.top(s) for s in range(self.segments)]
    return rings

  def segments_of(self, h, place):
    """The segments of piece `place` of host `h` (none past its pieces)."""
    if place >= self.pieces[h]:
      return range(0)
    step = self.denominator // self.pieces[h]
    return range(bisect.bisect_left(self.cuts, place * step),
                 bisect.bisect_left(self.cuts, (place + 1) * step))

  @functools.cached_property
  def _places(self):
    """member -> place(member), built once: O(workers) for them all."""
    return {j: (i, k, h == rack[0], h)
            for k, rack in enumerate(self.racks) for h in rack
            for i, j in enumerate(self.hosts[h])}

  def place(self, me):
    """(place on its host, rack index, its host leads its rack, host index);
    the member holds a piece when its place is below its host's pieces."""
    try:
      return self._places[me]
    except KeyError:
      raise ValueError(f"worker {me} is not in the layout") from None


def _cut(sizes):
  """(pieces by size, denominator, cuts): fitted if every piece crosses in
  at most MAX_SEGMENTS segments, else even."""
  distinct = sorted(set(sizes))
  denominator = math.lcm(*distinct)
  if denominator <= _MAX_DENOMINATOR:
    cuts = sorted({i * denominator // p for p in distinct
                   for i in range(p + 1)})
    widest = max(bisect.bisect_left(cuts, (i + 1) * denominator // p) -
                 bisect.bisect_left(cuts, i * denominator // p)
                 for p in distinct for i in range(p))
    if widest <= MAX_SEGMENTS:
      return {p: p for p in distinct}, denominator, tuple(cuts)
  fewest = distinct[0]
  return ({p: fewest for p in distinct}, fewest,
          tuple(range(fewest + 1)))


def shard_layout(hosts, members, max_leaders=None):
  """The ShardLayout of a global sync of `members`, or None: with one host,
  a host of one member, or a host of twice the fewest members or more
  (those syncs go leader by leader, plan_changes.host_part)."""
  by_host = {}
  for i in sorted(members):
    by_host.setdefault(hosts[i], []).append(i)
  groups = sorted(tuple(g) for g in by_host.values())
  if len(groups) < 2:
    return None
  fewest = min(len(g) for g in groups)
  if fewest < 2 or 2 * fewest <= max(len(g) for g in groups):
    return None
  leaders = [g[0] for g in groups]
  index = {g[0]: h for h, g in enumerate(groups)}
  racks = racks_of(leaders, max_leaders or len(leaders))
  pieces, denominator, cuts = _cut([len(g) for g in groups])
  return ShardLayout(tuple(groups),
                     tuple(tuple(index[i] for i in r) for r in racks),
                     tuple(pieces[len(g)] for g in groups), denominator,
                     cuts)
