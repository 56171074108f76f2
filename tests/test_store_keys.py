"""The store's key layout (protocol/store_keys.py) spells every key as the
protocol always has: a running job's keys, and a benchmark's or a tool's
reading them, do not change with the code that names them."""

from oscars_tf.protocol import store_keys


def test_every_key_is_spelled_as_before():
  assert [
      store_keys.arrivals(7), store_keys.arrival(7, 12),
      store_keys.decision(7), store_keys.snapshot(7),
      store_keys.rejoin_request(12), store_keys.latest(),
      store_keys.finished(), store_keys.done(12), store_keys.job(),
      store_keys.agreement(7, 2), store_keys.agreement_numbers(7, 2, 12),
      store_keys.exchange_text("stop", 2, 12),
      store_keys.exchange_read("stop", 2, 12), store_keys.table_row(12),
  ] == [
      "oscars_tf/members/a/7", "oscars_tf/members/a/7/12",
      "oscars_tf/members/d/7", "oscars_tf/members/s/7",
      "oscars_tf/members/j/12", "oscars_tf/members/latest",
      "oscars_tf/members/finished", "oscars_tf/members/done/12",
      "oscars_tf/members/job",
      "oscars_tf/agree/7/2", "oscars_tf/agree/7/2/12",
      "oscars_tf/agree/exchange/stop/2/12",
      "oscars_tf/agree/exchange/stop/2/read/12", "oscars_tf/table/12",
  ]


def test_a_round_directory_holds_its_arrivals():
  assert store_keys.arrival(3, 5).startswith(store_keys.arrivals(3) + "/")
  assert not store_keys.arrival(30, 5).startswith(store_keys.arrivals(3) +
                                                  "/")


def test_keys_are_read_back():
  assert store_keys.arrival_of(store_keys.arrival(7, 12)) == (7, 12)
  assert store_keys.arrival_of(store_keys.decision(7)) is None
  assert store_keys.decision_round(store_keys.decision(7)) == 7
  assert store_keys.decision_round(store_keys.snapshot(7)) is None
  assert store_keys.decision_round(store_keys.latest()) is None
  assert store_keys.worker_of(store_keys.arrival(7, 12)) == 12
  assert store_keys.worker_of(store_keys.latest()) is None
