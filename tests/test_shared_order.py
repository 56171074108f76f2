"""frontends/shared_order.py: one sample order per epoch, cut by the plan."""

import threading

import numpy as np
import pytest

from oscars_tf.errors import OscarsError
from oscars_tf.frontends import shared_order


def _epoch_of_rounds(orders, epoch, rounds):
  """Tells each worker's order its part of every round, as Rounds does:
  worker i's part starts after the cluster's steps so far and those of the
  workers before it in the round's plan."""
  done = 0
  for k in rounds:
    for i, order in enumerate(orders):
      order.add_slice(epoch, done + sum(k[:i]), k[i])
    done += sum(k)


@pytest.mark.parametrize("shuffle", [True, False])
def test_uneven_workers_see_every_sample_once_per_epoch(shuffle):
  n, batch = 1000, 10
  orders = [shared_order.SharedOrder(n, batch, shuffle) for _ in range(4)]
  # 100 cluster steps per epoch, a fast worker taking 4x a slow one's.
  plans = [[(8, 4, 4, 2)] * 5 + [(4, 2, 2, 2)], [(2, 4, 8, 4)] * 5 +
           [(4, 2, 2, 2)]]
  steps = [0] * 4
  for epoch, rounds in enumerate(plans):
    _epoch_of_rounds(orders, epoch, rounds)
    seen = []
    for i, order in enumerate(orders):
      mine = sum(k[i] for k in rounds)
      seen += [order.indices(s) for s in range(steps[i], steps[i] + mine)]
      steps[i] += mine
    seen = np.concatenate(seen)
    assert len(seen) == n
    assert sorted(seen.tolist()) == list(range(n)), epoch


def test_epochs_are_shuffled_alike_on_every_worker_and_differ_by_epoch():
  a, b = (shared_order.SharedOrder(50, 5) for _ in range(2))
  for order in (a, b):
    order.add_slice(0, 0, 10)
    order.add_slice(1, 0, 10)
  first = [a.indices(s).tolist() for s in range(20)]
  assert first == [b.indices(s).tolist() for s in range(20)]
  assert sorted(sum(first[:10], [])) == list(range(50))
  assert first[:10] != first[10:]
  assert sum(first[:10], []) != list(range(50))  # shuffled


def test_a_partial_last_batch_tops_up_from_the_epochs_start():
  order = shared_order.SharedOrder(25, 10, shuffle=False)
  order.add_slice(0, 0, 3)
  assert order.indices(2).tolist() == [20, 21, 22, 23, 24, 0, 1, 2, 3, 4]


def test_with_steps_per_epoch_unshuffled_epochs_read_on_through_the_data():
  # fit(x, y, shuffle=False, steps_per_epoch=...) shorter than the data:
  # as in Keras, the next epoch goes on where the last one stopped, so
  # every sample is trained on, not the first ones in every epoch.
  order = shared_order.SharedOrder(100, 10, shuffle=False, epoch_steps=3)
  for epoch in range(4):
    order.add_slice(epoch, 0, 3)
  firsts = [int(order.indices(step)[0]) for step in range(12)]
  assert firsts == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 0, 10]
  again = shared_order.SharedOrder(100, 10, shuffle=False)  # no epoch_steps
  again.add_slice(0, 0, 3)
  again.add_slice(1, 0, 3)
  assert int(again.indices(3)[0]) == 0  # a whole epoch: each starts afresh


def test_reads_are_by_step_so_a_second_stream_reads_the_same_batches():
  order = shared_order.SharedOrder(100, 10)
  order.add_slice(0, 3, 2)
  order.add_slice(0, 9, 1)
  first = [order.indices(s).tolist() for s in range(3)]
  assert first == [order.indices(s).tolist() for s in range(3)]
  assert first[2] == order.indices(2).tolist()


def test_a_read_ahead_waits_for_its_round_then_closing_releases_it():
  order = shared_order.SharedOrder(100, 10, shuffle=False)
  order.add_slice(0, 0, 1)
  got, started = {}, threading.Event()

  def read(step):
    started.set()
    got[step] = order.indices(step).tolist()

  reader = threading.Thread(target=read, args=(1,))
  reader.start()
  assert started.wait(10)
  reader.join(0.2)
  assert reader.is_alive() and 1 not in got  # waits: no plan for step 1
  order.add_slice(0, 5, 1)
  reader.join(10)
  assert got[1] == list(range(50, 60))
  late = threading.Thread(target=read, args=(2,))
  late.start()
  order.close()
  late.join(10)
  assert not late.is_alive() and len(got[2]) == 10


def test_a_read_that_no_plan_reaches_fails_after_its_timeout():
  order = shared_order.SharedOrder(100, 10, timeout=0.05)
  with pytest.raises(OscarsError, match="no round planned"):
    order.indices(0)


def test_bad_sizes_are_refused():
  with pytest.raises(ValueError):
    shared_order.SharedOrder(0, 10)
