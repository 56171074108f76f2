"""The chief's side of a round end: collect rows, decide, write the decision.

The chief (worker 0) waits for the members' rows, up to
`straggler_timeout` seconds after its own arrival (arrival_reads.py; on a
job of several hosts its own host's through files, host_arrivals.py); a
member that is not there by then, or whose process is gone, is dropped
from the round. It lets in the dropped workers that asked to rejoin
(rejoin.py), then writes one decision per round — the members, the
newcomers and every row — the way the job's distribution says
(distributions.py), and the round as the store's latest. Membership
(membership.py) is the worker's way in. No TensorFlow here.
"""

from absl import logging

from oscars_tf.protocol import arrival_reads
from oscars_tf.protocol import decision_codec
from oscars_tf.protocol import host_relay
from oscars_tf.protocol import rejoin
from oscars_tf.protocol import store_keys
from oscars_tf.protocol.decision import Decision
from oscars_tf.protocol.kv_store import put

PUBLISH_MARGIN_S = 5.0  # at most: see publish_margin
KEEP_ROUNDS = 1000  # decisions kept in the store (older ones are deleted)


class Chief:
  """Worker 0's decisions, one per round."""

  def __init__(self, worker, codec):
    """`worker`: the chief's Membership (its store, clock, timeouts,
    members, hooks and events, read at each round: a timeout changed takes
    effect at the next); `codec`: its distribution's (distributions.py)."""
    self.worker = worker
    self.codec = codec
    if worker.relay is not None:  # the job's incarnation, for host files
      worker.relay.bind(host_relay.new_token())
      put(worker.store, store_keys.job(), worker.relay.token)

  def decide(self, round_, my_row, epoch_done, chief_plan, expected_s=0.0,
             expected_steps=None):
    """The Decision of `round_`, written for the members; `my_row`: the
    chief's row (store text). The arguments are Membership.exchange's."""
    w = self.worker
    rows = {0: my_row}  # store texts, decoded at once
    t0 = w.clock.monotonic()
    straggler_s = w.straggler_timeout if round_ else w.first_round_timeout
    # Invariant: the chief decides within a member's wait for the decision
    # (`member_wait`, from the member's own arrival) less a margin to
    # publish and be read. The members `expected_s` waits for arrive after
    # the chief, so none of them gives up first, however long the chief
    # expected them to take (issue 43: it waited up to decision_timeout +
    # straggler_timeout).
    members_wait = w.member_wait(round_)
    deadline = t0 + min(max(0.0, expected_s) + straggler_s,
                        members_wait - publish_margin(members_wait))
    others = [j for j in w.members if j != 0]
    arrival_reads.read_arrivals(
        w.store, round_, others, w.members, rows, deadline, w.is_gone,
        w.arrivals, w.clock)
    arrived = [0] + [j for j in others if j in rows]
    dropped = [j for j in others if j not in rows]
    if dropped:
      w.hooks.dropped(dropped)
      logging.warning(
          "oscars_tf: worker(s) %s dropped at round %d (not at the round "
          "end within %.3g s of the chief, or gone); the others go on.",
          dropped, round_, straggler_s)
    for j in dropped:
      w.events.append((round_, "dropped", j, w.clock.monotonic() - t0))
    was_member = set(w.members)  # a set: `in` a tuple is O(workers)
    asked = rejoin.requests(
        w.store, [j for j in range(1, w.n) if j not in was_member],
        w.is_gone, w.clock)
    rows.update(asked)
    newcomers = list(asked)
    if newcomers:
      logging.warning("oscars_tf: worker(s) %s let back in at round %d.",
                      newcomers, round_)
    # Every arrival of the round is read (or the chief's own): one call
    # deletes them all (a directory), not one RPC per member.
    w.store.delete(store_keys.arrivals(round_))
    if newcomers and callable(chief_plan):  # made only when needed
      chief_plan = chief_plan()
    members = tuple(sorted(arrived + newcomers))
    table = decision_codec.rows_array(w.n, rows)
    decision = Decision(round_, members, tuple(newcomers), tuple(dropped),
                        decision_codec.RowView(table, members), epoch_done,
                        chief_plan if newcomers else None, row_array=table)
    return self._publish(decision, expected_steps)

  def _publish(self, decision, expected_steps):
    """Writes `decision`; returns it as the members will read it."""
    w = self.worker
    text, decision = self.codec.publish(decision, expected_steps)
    if w.relay is not None:  # the chief leads its host
      w.relay.write(decision.round, text)
    put(w.store, store_keys.latest(), str(decision.round))
    w.store.delete(store_keys.decision(decision.round - KEEP_ROUNDS))
    return decision


def publish_margin(members_wait):
  """Seconds the chief keeps, of the members' wait, to publish in time."""
  return min(PUBLISH_MARGIN_S, members_wait / 4)
