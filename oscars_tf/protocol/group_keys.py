"""Collective group keys, exact by construction: one per distinct group.

TensorFlow binds a group key to the first membership it is used with and
rejects it with any other, so two groups must never share a key. A hash of
the members cannot promise that (crc32 modulo 2**19 collided within 5
rounds at 256 workers). Here each distinct group gets the next number, in
the order groups first appear in the plans. Every member registers every
group of each round's plan in the same canonical order, from the same
decision, so all members hold the same table; a worker that rejoins takes
the chief's (see rejoin.adopt).

No TensorFlow here.
"""

GROUP_KEY_BASE = 1 << 20  # far above the keys MirroredStrategy allocates


class GroupKeys:
  """The group -> key table of one worker."""

  def __init__(self, num_workers, groups=None):
    # The whole cluster is always key GROUP_KEY_BASE (start-up uses it).
    self.groups = [tuple(range(num_workers))]
    self._keys = {self.groups[0]: GROUP_KEY_BASE}
    for g in groups or ():
      self._add(tuple(g))

  def register(self, groups):
    """Gives each group of `groups` not seen before the next key, in the
    order given (call with the same groups in the same order everywhere)."""
    for g in groups:
      g = tuple(sorted(g))
      if g not in self._keys:
        self._add(g)

  def key(self, group):
    """The key of a registered group. (A worker alone has one too: a group
    of one may still be resolved at the cluster's group leader.)"""
    group = tuple(sorted(group))
    try:
      return self._keys[group]
    except KeyError:
      raise KeyError(f"group {list(group)} was never registered: every "
                     "member must register a plan's groups before use"
                     ) from None

  def _add(self, group):
    self._keys[group] = GROUP_KEY_BASE + len(self.groups)
    self.groups.append(group)

  def __len__(self):
    return len(self.groups)
