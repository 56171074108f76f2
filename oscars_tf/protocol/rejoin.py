"""A dropped worker's way back in: the protocol side of a rejoin, whole.

A worker left out of its round's decision (a stall ended) asks to rejoin
(its row under store_keys.rejoin_request) and reads the decisions from the
round after the chief's latest on, until one names it a newcomer; in that
round it takes its group's model (weight 0) and the chief's plan. The path,
in order:

* `as_newcomer`: the dropped worker (Membership.exchange, once its round's
  decision leaves it out) asks and waits (`wait_to_rejoin`), reading each
  decision its distribution's way (distributions.py: with "deltas" a
  newcomer reads the whole snapshot, which carries the chief's plan);
* `requests`: the chief, deciding a round (membership_chief.py), takes the
  requests in and lets back those whose processes are not gone;
* `adopt`: the rejoiner's round book (RoundBook._adopt) takes the chief's
  round, epoch accounting, plan, planner state and group keys.

Elsewhere, and why: the chief makes what newcomers adopt (the `chief_plan`
of round_exchange.RoundExchange.decide); a newcomer's row is marked
current in RoundExchange.part_in and plan_changes.with_members (policy/)
gives it its weight; round_parts.RoundPart's `rejoining` and `takes_model`
tell the graph. The graph side (TensorFlow): distribute/rounds.py
(`Rounds.round_end_ops` averages the shared state in a round with
newcomers, `_share`) and distribute/outer.py (`OuterState.variables`: the
outer momentum state a rejoiner takes from the others).

Two skews of the store are handled here (issue 43, item 11):

* The chief rewrites `latest` as a delete then a set (the coordination
  service refuses to overwrite a key), so a read can find it missing for a
  moment. A dropped worker has seen its round's decision, and the chief
  sets `latest` right after each decision, so a missing `latest` is that
  gap (or a dead chief): the rejoiner waits for it instead of starting from
  its own round, which cost one read per round since, and past
  membership_chief.KEEP_ROUNDS a wait on a deleted key until the timeout.
* A rejoiner held up while the chief went on (let in, then dropped again)
  finds the decision it waits for deleted: `latest` at or past its round
  with the decision missing says so, and it asks again for the round after
  `latest`.

No TensorFlow here.
"""

import dataclasses

from absl import logging

from oscars_tf.errors import PeerTimeoutError
from oscars_tf.errors import WorkerLostError
from oscars_tf.policy import planner_state
from oscars_tf.protocol import clock as clock_lib
from oscars_tf.protocol import distributions
from oscars_tf.protocol import group_keys as group_keys_lib
from oscars_tf.protocol import kv_store
from oscars_tf.protocol import store_keys
from oscars_tf.protocol.kv_store import KeyMissing
from oscars_tf.protocol.kv_store import put

POLL_S = 0.5  # a dropped worker checks for the end of training this often


# -- the dropped worker ----------------------------------------------------

def as_newcomer(worker, round_, row_text):
  """The Decision that lets `worker` (a Membership, dropped at `round_`)
  back in, asking with `row_text`; its wait goes to `worker.events`."""
  t0 = worker.clock.monotonic()
  decision = wait_to_rejoin(
      worker.store, worker.me, round_, row_text, worker.decision_timeout,
      worker.codec, worker.hooks.asked_to_rejoin, worker.clock)
  worker.events.append((decision.round, "rejoined", worker.me,
                        worker.clock.monotonic() - t0))
  return decision


def wait_to_rejoin(store, me, round_, row_text, timeout, codec,
                   asked_to_rejoin=lambda: None, clock=None):
  """The Decision of the round that lets worker `me` back in.

  `me` was dropped at `round_` and asks with `row_text` (its encoded row);
  it gives up (PeerTimeoutError, its request withdrawn) after `timeout`
  seconds, or when training ends (WorkerLostError). `codec`: the job's
  distribution's (distributions.py), which reads each decision."""
  clock = clock_lib.real_unless(clock)
  deadline = clock.monotonic() + timeout

  def ask():
    put(store, store_keys.rejoin_request(me), row_text)
  latest = _latest(store, deadline, clock)
  ask()
  asked_to_rejoin()
  r = max(round_, latest) + 1
  while True:
    try:
      text = store.get(store_keys.decision(r),
                       min(POLL_S, clock.left(deadline)))
    except KeyMissing:
      if kv_store.value_now(store, store_keys.finished()) is not None:
        raise WorkerLostError(
            f"worker {me} was dropped at round {round_} (too late at its "
            "round end) and training ended before it could rejoin; the "
            "chief's model and checkpoint are the job's result.") from None
      latest = _int_or(kv_store.value_now(store, store_keys.latest()), -1)
      if latest >= r:  # round r was decided and its decision deleted since
        ask()  # the chief may have read and dropped the request meanwhile
        r = latest + 1
        continue
      if clock.left(deadline) <= 0:
        store.delete(store_keys.rejoin_request(me))  # not asking any more
        raise PeerTimeoutError(
            f"worker {me}: dropped at round {round_}, and not let back in "
            f"within {timeout:.0f} s.") from None
      continue
    decision = codec.newcomer_decision(r, text, me, deadline)
    if decision is distributions.MISSING:  # too slow even for that
      ask()
      r += 1
      continue
    if decision is not None and me in decision.newcomers:
      return decision
    r += 1


def _latest(store, deadline, clock):
  """The chief's latest round; waited for (until `deadline`) if missing:
  the chief is between its delete and set. -1 if it never comes."""
  try:
    return _int_or(store.get(store_keys.latest(), clock.left(deadline)), -1)
  except KeyMissing:
    return -1


# -- the chief -------------------------------------------------------------

def requests(store, outside, is_gone, clock=None):
  """The chief: {worker: row text} of the workers of `outside` (not
  members of the last round) that asked to rejoin, in `outside`'s order;
  no waiting (asked already or not). Each request read is deleted; one
  whose process died while it waited is not let in: every member would
  wait for it in the round's collective until collective_timeout."""
  clock = clock_lib.real_unless(clock)
  asked = kv_store.values_unless_gone(
      store, [store_keys.rejoin_request(j) for j in outside],
      clock.monotonic(), clock=clock)
  let_in = {}
  for j, text in zip(outside, asked):
    if text is not None:
      store.delete(store_keys.rejoin_request(j))
      if not is_gone(j):
        let_in[j] = text
  return let_in


# -- the rejoiner's round book ---------------------------------------------

def adopt(book, decision, rate_before):
  """A rejoining worker's round book (round_book.RoundBook) takes the
  cluster's round, epoch accounting and planner state from the chief's
  `decision`, so it plans and ends epochs like the others from here on;
  its rate is `rate_before` (measured before its stall)."""
  logging.warning(
      "oscars_tf: worker %d was dropped at round %d (late at its round "
      "end) and rejoins at round %d with the group's model.", book.me,
      book.round, decision.round)
  book.round, book.epoch_done = decision.round, decision.epoch_done
  book.meter.reset(rate_before)  # the stall is not its speed
  adopted = decision.chief_plan or {}
  book.group_keys = group_keys_lib.GroupKeys(
      book.n, adopted.get("group_keys", [])[1:])
  book.epoch_offset = adopted.get("epoch", book.epoch_index) - (
      book.epoch_index)
  # The round's plan as the others hold it (its own is from before the
  # stall): the weights of this round, host shares included, then agree.
  book.plan = dataclasses.replace(
      book.plan, epoch_end=bool(adopted.get("epoch_end", False)),
      local_steps=tuple(adopted.get("local_steps", book.plan.local_steps)))
  if adopted.get("state") is not None:
    book.plan = dataclasses.replace(
        book.plan, state=planner_state.state_from_json(
            type(book.plan.state), adopted["state"]))


def _int_or(text, default):
  try:
    return int(text)
  except (TypeError, ValueError):
    return default
