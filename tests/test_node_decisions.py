"""Node 0's decisions for a job on several nodes (tools/node_decisions.py),
and the channel that carries them (tools/node_channel.py) over real
loopback sockets, with the nodes' launchers as threads. No TensorFlow,
no worker processes: the launchers themselves are tested in
test_node_launchers.py.
"""

import signal
import socket
import threading

import pytest

from oscars_tf.errors import PEER_LOST_EXIT_CODE
from oscars_tf.tools import node_channel
from oscars_tf.tools import node_decisions as nd
from oscars_tf.tools import rendezvous

KILLED = -signal.SIGKILL


def _report(outcome, exits=None, cause=None, lost=()):
  return {"outcome": outcome, "cause": cause, "lost": list(lost),
          "exits": {str(i): c for i, c in (exits or {}).items()}}


def _budgets(restarts=0, lost_peer=3):
  return nd.Budgets(restarts, lost_peer)


def test_every_node_finished_is_exit_0_even_with_lost_workers_or_nodes():
  d = nd.decide({0: _report(nd.FINISHED, {0: 0, 1: 0}),
                 1: _report(nd.FINISHED, {2: KILLED, 3: 0}, lost=[2])},
                gone=set(), budgets=_budgets(), total=4)
  assert (d.restart, d.code) == (False, 0)
  assert d.why == ("all 4 workers of every node finished (lost during "
                   "training: worker(s) [2]).")
  d = nd.decide({0: _report(nd.FINISHED, {0: 0})}, gone={1},
                budgets=_budgets())
  assert d.code == 0 and "but node(s) [1] (launcher gone)" in d.why


def test_a_death_on_one_node_and_75s_on_another_is_a_lost_peer():
  # The chief (node 0) exits 75 because worker 2 (node 1) died inside
  # their collective: neither node sees both, node 0 decides from both.
  reports = {0: _report(nd.FAILED, {0: PEER_LOST_EXIT_CODE},
                        cause="worker 0 exited with code 75"),
             1: _report(nd.FINISHED, {2: KILLED}, lost=[2])}
  budgets = _budgets(restarts=0, lost_peer=1)
  d = nd.decide(reports, set(), budgets)
  assert (d.restart, d.lost_peer) == (True, True)
  assert budgets.lost_peer_restarts == 0
  assert d.why.startswith("node 0: worker 0 exited with code 75: a lost "
                          "peer; restarting")
  d = nd.decide(reports, set(), budgets)  # the budget is spent
  assert (d.restart, d.code) == (False, 1)


def test_an_error_restarts_within_restarts_then_ends_with_1():
  reports = {0: _report(nd.STOPPED, {0: 0}),
             1: _report(nd.FAILED, {2: 1}, cause="worker 2 exited with "
                        "code 1")}
  budgets = _budgets(restarts=1)
  d = nd.decide(reports, set(), budgets)
  assert d.restart and not d.lost_peer and budgets.restarts == 0
  assert d.why == ("node 1: worker 2 exited with code 1; restarting every "
                   "node's workers.")
  d = nd.decide(reports, set(), budgets)
  assert (d.restart, d.code) == (False, 1)
  assert d.why.endswith("; stopped every node's workers.")


def test_a_gone_node_is_a_lost_peer_then_signal_and_timeout_codes():
  # Node 1's launcher died with its workers inside a collective: node 0's
  # chief exits 75 and sees no death; the gone node is the lost peer.
  reports = {0: _report(nd.FAILED, {0: PEER_LOST_EXIT_CODE}, cause="c")}
  budgets = _budgets(restarts=2, lost_peer=1)
  d = nd.decide(reports, {1}, budgets)
  assert (d.restart, d.lost_peer) == (True, True)
  assert "restarting every node's workers but node(s) [1] (launcher " \
         "gone) from the newest saved state" in d.why
  d = nd.decide(reports, {1}, budgets)
  assert (d.restart, d.code) == (False, 1)
  assert "no restart: node(s) [1] left the job" in d.why
  d = nd.decide({0: _report(nd.STOPPED)}, {1}, _budgets(),
                signal_from=(1, 15))
  assert (d.restart, d.code) == (False, 143)
  assert d.why.startswith("node 1's launcher got signal 15")
  d = nd.decide({0: _report(nd.TIMEOUT), 1: _report(nd.STOPPED)}, set(),
                _budgets(restarts=5))
  assert (d.restart, d.code) == (False, 124)


def _nodes(n, budgets, after_chief=60.0):
  """A Hub and n - 1 Links, connected over loopback as after a
  rendezvous."""
  listener = rendezvous.listen("127.0.0.1", 0)
  port = listener.getsockname()[1]
  hellos = [rendezvous.hello("j", n, r, 1, [30000 + r], "127.0.0.1")
            for r in range(n)]
  served = {}
  server = threading.Thread(target=lambda: served.update(
      result=rendezvous.serve(listener, hellos[0], 10, keep=True)))
  server.start()
  joins = [_in_thread(rendezvous.join, ("127.0.0.1", port), hellos[r], 10,
                      None, True) for r in range(1, n)]
  server.join(10)
  for t, _ in joins:
    t.join(10)
  joined = [out["value"] for _, out in joins]
  cluster, conns = served["result"]
  said = []
  hub = node_channel.Hub(conns, cluster, budgets, said.append,
                         after_chief=after_chief)
  links = [node_channel.Link(conn, c, r + 1, said.append)
           for r, (c, conn) in enumerate(joined)]
  return hub, links, said


def _in_thread(fn, *args):
  out = {}
  t = threading.Thread(target=lambda: out.update(value=fn(*args)))
  t.start()
  return t, out


def _no_signal():
  return None


def test_a_failure_on_node_1_stops_node_0_and_both_restart_together():
  hub, (link,), said = _nodes(2, _budgets(restarts=1))
  try:
    assert hub.stop_order() is None and link.stop_order() is None
    # Node 1's worker failed: its attempt ends; node 0 is told to stop.
    t, out = _in_thread(link.ended, _report(nd.FAILED, {1: 1}, cause="w"),
                        [31000], _no_signal)
    _wait_for(lambda: hub.stop_order() is not None)
    assert hub.stop_order() == (signal.SIGTERM, "node 1's attempt failed")
    decision = hub.ended(_report(nd.STOPPED), [32000], _no_signal, 1.0)
    t.join(10)
    assert decision.restart and out["value"].restart
    assert hub.attempt == link.attempt == 1
    assert link.cluster == hub.cluster
    assert hub.cluster["workers"] == ["127.0.0.1:32000", "127.0.0.1:31000"]
    # A stop of attempt 0 no longer counts: attempt 1 runs unstopped.
    assert hub.stop_order() is None and link.stop_order() is None
    t, out = _in_thread(link.ended, _report(nd.FINISHED, {1: 0}), [1],
                        _no_signal)
    decision = hub.ended(_report(nd.FINISHED, {0: 0}), [2], _no_signal, 1.0)
    t.join(10)
    assert (decision.restart, decision.code) == (False, 0)
    assert (out["value"].restart, out["value"].code) == (False, 0)
    assert any("stopping every node's workers" in line for line in said)
  finally:
    hub.close()
    link.close()


def test_a_signal_on_node_2_stops_the_others_with_that_signal():
  hub, (link1, link2), _ = _nodes(3, _budgets(restarts=3))
  try:
    link2.tell_signal(signal.SIGTERM)
    link2.close()
    _wait_for(lambda: link1.stop_order() is not None)
    assert link1.stop_order()[0] == signal.SIGTERM
    assert hub.stop_order() == (signal.SIGTERM,
                                "node 2's launcher got signal 15")
    t, out = _in_thread(link1.ended, _report(nd.STOPPED), [1], _no_signal)
    decision = hub.ended(_report(nd.STOPPED), [2], _no_signal, 1.0)
    t.join(10)
    assert (decision.restart, decision.code) == (False, 143)
    assert out["value"].code == 143
  finally:
    hub.close()
    link1.close()


def test_a_gone_node_is_left_out_and_node_0_gone_ends_the_others():
  hub, (link1, link2), said = _nodes(3, _budgets())
  try:
    link2.close()  # its launcher killed: the connection closes
    _wait_for(lambda: 2 in hub.gone)
    assert any("node 2's launcher is gone" in line for line in said)
    t, out = _in_thread(link1.ended, _report(nd.FINISHED), [1], _no_signal)
    decision = hub.ended(_report(nd.FINISHED), [2], _no_signal, 1.0)
    t.join(10)
    assert decision.code == 0 and "but node(s) [2]" in decision.why
    assert out["value"].code == 0
  finally:
    hub.close()
  # Node 0 gone: a Link is told to stop, and ends with 1 when asked.
  _wait_for(lambda: link1.stop_order() is not None)
  assert "node 0's launcher is gone" in link1.stop_order()[1]
  d = link1.ended(_report(nd.STOPPED), [1], _no_signal)
  assert (d.restart, d.code) == (False, 1)
  link1.close()


def test_a_node_lost_in_an_earlier_attempt_does_not_decide_later_ones():
  """Node 2 left in attempt 0 (a lost-peer restart without it). A bug in
  attempt 1 is then decided by --restarts (0 here): it ends the job with
  1. Before, the node's departure counted in every later attempt: each
  failure was restarted as a lost peer while that budget lasted."""
  hub, (link1, link2), _ = _nodes(3, _budgets(restarts=0, lost_peer=3))
  try:
    link2.close()
    _wait_for(lambda: 2 in hub.gone)
    t, out = _in_thread(link1.ended, _report(nd.STOPPED), [1], _no_signal)
    decision = hub.ended(_report(nd.FAILED, {0: PEER_LOST_EXIT_CODE},
                                 cause="chief exited with code 75"),
                         [2], _no_signal, 1.0)
    t.join(10)
    assert (decision.restart, decision.lost_peer) == (True, True)
    assert hub.cluster["workers"] == ["127.0.0.1:2", "127.0.0.1:1"]
    t, out = _in_thread(link1.ended,
                        _report(nd.FAILED, {1: 1}, cause="worker 1 exited "
                                "with code 1"), [1], _no_signal)
    decision = hub.ended(_report(nd.STOPPED), [2], _no_signal, 1.0)
    t.join(10)
    assert (decision.restart, decision.code) == (False, 1), decision.why
    assert decision.why == ("node 1: worker 1 exited with code 1; stopped "
                            "every node's workers.")
    assert out["value"].code == 1
  finally:
    hub.close()
    link1.close()


def test_nodes_still_running_after_node_0_finished_are_stopped():
  hub, (link,), said = _nodes(2, _budgets(), after_chief=0.3)
  try:
    t, out = _in_thread(hub.ended, _report(nd.FINISHED, {0: 0}), [2],
                        _no_signal, 1.0)
    _wait_for(lambda: link.stop_order() is not None)
    assert "still ran 0.3 s after node 0 finished" in link.stop_order()[1]
    link.ended(_report(nd.STOPPED), [1], _no_signal)
    t.join(10)
    assert out["value"].code == 0  # stopped, not failed: as on one node
  finally:
    hub.close()
    link.close()


def _wait_for(predicate, timeout=10.0):
  done = threading.Event()
  deadline = threading.Timer(timeout, done.set)
  deadline.start()
  try:
    while not predicate():
      if done.wait(0.02):
        pytest.fail("timed out")
  finally:
    deadline.cancel()


def test_free_ports_are_distinct():
  from oscars_tf.tools.job_layout import free_ports  # noqa: PLC0415
  ports = free_ports(3, "0.0.0.0")
  assert len(set(ports)) == 3
  with socket.socket() as s:
    s.bind(("0.0.0.0", ports[0]))
