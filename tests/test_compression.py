"""Compressed averaging: the quantizer's bounds, error feedback, and the
compressed sum between two members (this process's two logical CPUs, one
thread each, as two workers' collectives would meet)."""

import collections
import dataclasses
import threading

import numpy as np
import pytest
import tensorflow as tf

import oscars_tf
from oscars_tf.distribute import compression
from oscars_tf.distribute import startup
from oscars_tf.runtime import averagers
from oscars_tf.runtime import averaging
from oscars_tf.runtime import compressed
from oscars_tf.runtime import quantize

BITS = (8, 4)


def _vectors(seed, blocks=24):
  """Blocks of very different magnitudes, a block of zeros, and a block
  whose largest value is negative: what a model's change looks like."""
  rng = np.random.default_rng(seed)
  scales = 10.0 ** rng.uniform(-6, 3, size=(blocks, 1))
  x = (rng.standard_normal((blocks, quantize.BLOCK)) * scales)
  x[3] = 0.0
  x[5] = -np.abs(x[5])
  return x.astype(np.float32).ravel()


def _bound(x, bits):
  """Half a level of each value's block."""
  peak = np.abs(x.reshape(-1, quantize.BLOCK)).max(axis=1, keepdims=True)
  return np.broadcast_to(peak / (2 * quantize.levels(bits)),
                         (len(peak), quantize.BLOCK)).ravel()


def _round_trip(x, bits):
  q, scales = quantize.quantize(tf.constant(x), bits)
  words = quantize.pack(q[None], scales[None], bits)
  back, back_scales = quantize.unpack(words, len(x), bits)
  return q, words, back[0], quantize.dequantize(back[0], back_scales[0])


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("seed", range(5))
def test_a_value_comes_back_within_half_a_level_of_its_block(bits, seed):
  x = _vectors(seed)
  q, words, back, x_hat = _round_trip(x, bits)
  np.testing.assert_array_equal(back.numpy(), q.numpy())
  error = np.abs(x_hat.numpy() - x)
  assert (error <= _bound(x, bits) * (1 + 1e-5) + 1e-30).all(), (
      error / _bound(x, bits)).max()
  assert (x_hat.numpy()[3 * quantize.BLOCK:4 * quantize.BLOCK] == 0).all()
  # Its size: the levels, then one word a scale.
  assert words.shape == (1, quantize.words_of(len(x), bits))
  assert words.shape[1] * 4 * (32 // bits) <= len(x) * 4 * 1.15


@pytest.mark.parametrize("bits", BITS)
def test_every_level_packs_and_unpacks_to_itself(bits):
  top = quantize.levels(bits)
  levels = np.tile(np.arange(-top, top + 1), quantize.BLOCK)[
      :2 * quantize.BLOCK].astype(np.int32)
  scales = tf.ones([2], tf.float32)
  words = quantize.pack(tf.constant(levels)[None], scales[None], bits)
  back, _ = quantize.unpack(words, len(levels), bits)
  np.testing.assert_array_equal(back.numpy()[0], levels)


@pytest.mark.parametrize("bits", BITS)
def test_error_feedback_sends_the_sum_of_the_truths_over_rounds(bits):
  """What is sent over T rounds sums to what was meant, less the last
  residual, and the residual never outgrows one rounding."""
  rng = np.random.default_rng(7)
  residual = np.zeros(8 * quantize.BLOCK, np.float32)
  truth = np.zeros_like(residual, dtype=np.float64)
  sent = np.zeros_like(truth)
  for _ in range(50):
    x = rng.standard_normal(residual.shape).astype(np.float32) * 0.01
    meant = x + residual
    q, scales = quantize.quantize(tf.constant(meant), bits)
    out = quantize.dequantize(q, scales).numpy()
    residual = meant - out
    truth += x
    sent += out
    assert (np.abs(residual) <= _bound(meant, bits) * (1 + 1e-5)).all()
  np.testing.assert_allclose(sent + residual, truth, atol=1e-5)


Part = collections.namedtuple(
    "Part", "group_size group_key weight rejoining takes_model",
    defaults=(1.0, False, False))


def _together(fn, members=2):
  """fn(member) on `members` threads at once (a collective needs them all);
  the results by member, or the first error."""
  results, errors = {}, []

  def run(member):
    try:
      results[member] = fn(member)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)
  threads = [threading.Thread(target=run, args=(m,)) for m in range(members)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert not errors, errors
  assert sorted(results) == list(range(members)), "a member never returned"
  return results


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("length", [1, 1000, 4096 + 7])
def test_two_members_decode_the_same_sum_and_keep_what_rounding_lost(
    bits, length):
  rng = np.random.default_rng(length)
  xs = [rng.standard_normal(length).astype(np.float32) for _ in range(2)]
  key = 9300 + bits + length % 97

  def member(m):
    summer = compressed.CompressedSum(bits, f"/device:CPU:{m}", 30.0,
                                      worker=[4, 1][m])
    fn = tf.function(lambda x: summer.sum(x, Part(tf.constant(2),
                                                  tf.constant(key))))
    return [t.numpy() for t in fn(tf.constant(xs[m]))]
  out = _together(member)
  totals = [out[m][0] for m in range(2)]
  np.testing.assert_array_equal(totals[0], totals[1])  # bit-identical
  truth = xs[0].astype(np.float64) + xs[1]
  lost = out[0][1].astype(np.float64) + out[1][1]
  # Nothing lost for good: the sum plus both members' residuals is the truth.
  np.testing.assert_allclose(totals[0] + lost, truth, atol=1e-5)
  # Two roundings (each contribution, then the shard's sum).
  peak = max(np.abs(x).max() for x in xs)
  assert np.abs(totals[0] - truth).max() <= 2 * peak / quantize.levels(bits)
  assert out[0][2] == out[1][2] == compressed.bytes_of(length, 2, bits)


def test_the_sum_is_traced_once_for_every_caller_of_one_length(monkeypatch):
  """A training step and an epoch's last round both average: the compressed
  sum's graph (a hundred-odd ops) is built once per vector length, not once
  per function that calls it."""
  built = collections.Counter()
  real_quantize = quantize.quantize

  def counted(x, bits, block=quantize.BLOCK):
    built[threading.current_thread().name] += 1
    return real_quantize(x, bits, block)
  monkeypatch.setattr(quantize, "quantize", counted)
  xs = [np.arange(200, dtype=np.float32) * (m + 1) for m in range(2)]

  def member(m):
    summer = compressed.CompressedSum(8, f"/device:CPU:{m}", 30.0, worker=m)
    part = Part(tf.constant(2), tf.constant(9350))
    callers = [tf.function(lambda x: summer.sum(x, part)),
               tf.function(lambda x: summer.sum(x * 1.0, part))]
    return [[t.numpy() for t in f(tf.constant(xs[m]))] for f in callers]
  out = _together(member)
  # Two quantizations a sum (the change, then the shard's sum), traced once.
  assert sorted(built.values()) == [2, 2], built
  for m in range(2):
    for first, second in zip(*out[m]):
      np.testing.assert_array_equal(first, second)
  np.testing.assert_allclose(out[0][0][0], xs[0] + xs[1], rtol=0.02, atol=3)


def test_a_compressed_round_averages_the_change_and_is_exact_when_asked():
  """The round: reference + the weighted changes; a weight-0 (poisoned)
  member sends nothing and keeps no residual; a rejoining round, the
  float64 variable and the non-trainable statistic (a variance near 0,
  which rounding could turn negative) are exact."""
  rng = np.random.default_rng(2)
  start = [rng.standard_normal((40, 30)).astype(np.float32),
           rng.standard_normal(7),  # float64: averaged exactly
           np.abs(rng.standard_normal(64)).astype(np.float32) * 1e-4]
  start[2][0] = 50.0  # one large variance beside tiny ones
  models = [[s + (0.01 * rng.standard_normal(s.shape)).astype(s.dtype)
             for s in start] for _ in range(2)]
  models[0][2] = np.abs(models[0][2])
  models[1][0][0, 0] = np.nan  # replaced by zeros, as round_end_ops does

  def member(m, weights, rejoining, poisoned=(False, True),
             residual=(0.0, np.nan)):
    state = compression.CompressionState([tf.constant(s) for s in start],
                                         trainable=[True, True, False])
    assert state.indices == [0]
    state.residual.assign(tf.fill(state.residual.shape, residual[m]))
    exact = averagers.UnlessAlone(averaging.GroupAverager(
        2, 9400, f"/device:CPU:{m}", "RING", 30.0))
    averaged_round = compression.CompressedRound(
        "int8", exact, f"/device:CPU:{m}", 30.0, worker=m)
    values = [tf.constant(np.nan_to_num(v, nan=0.0)) for v in models[m]]
    part = Part(tf.constant(2), tf.constant(9400),
                tf.constant(weights[m], tf.float32), tf.constant(rejoining),
                tf.constant(poisoned[m] or rejoining))
    out, sent = tf.function(averaged_round.weighted_sum)(values, part, state)
    return [v.numpy() for v in out], int(sent), state.residual.numpy()

  for weights, rejoining in (([1.0, 0.0], False), ([1.0, 0.0], True)):
    out = _together(lambda m, w=weights, r=rejoining: member(m, w, r))
    for i in range(2):
      np.testing.assert_array_equal(out[0][0][i], out[1][0][i])
    np.testing.assert_array_equal(out[0][0][1], models[0][1])  # exact
    np.testing.assert_array_equal(out[0][0][2], models[0][2])  # exact
    assert (out[0][0][2] > 0).all()
    error = np.abs(out[0][0][0] - models[0][0]).max()
    change = np.abs(models[0][0] - start[0]).max()
    if rejoining:
      assert error == 0.0 and out[0][1] == averaging.packed_bytes(
          [tf.constant(v) for v in models[0]])
    else:
      assert 0 < error <= change / quantize.levels(8), error
      assert out[0][1] < averaging.packed_bytes(
          [tf.constant(v) for v in models[0]]) / 3
      assert np.isfinite(out[1][2]).all() and not out[1][2].any()
  # A sound member at weight 0 (it took no steps this round: a member that
  # ran out of data before the epoch's end) sends the error it kept and
  # keeps what rounding loses: the model plus every member's residual is
  # the true sum. Before, its error was dropped as a poisoned member's.
  models[1][0][0, 0] = 0.5
  held = 0.003  # member 1's error from earlier rounds
  out = _together(lambda m: member(m, [1.0, 0.0], False, (False, False),
                                   (0.0, held)))
  np.testing.assert_array_equal(out[0][0][0], out[1][0][0])
  np.testing.assert_allclose(
      out[0][0][0].ravel() + out[0][2] + out[1][2],
      models[0][0].ravel() + held, rtol=0, atol=1e-5)


def test_bad_compression_arguments_are_clear_errors():
  with pytest.raises(ValueError, match="`compression` must be one of"):
    oscars_tf.OscarsStrategy(compression="int2")
  with pytest.raises(ValueError, match="takes no `averaging_dtype`"):
    oscars_tf.OscarsStrategy(compression="int4", averaging_dtype="bfloat16")
  assert oscars_tf.OscarsStrategy(compression="int8").compression == "int8"
  assert oscars_tf.OscarsStrategy().compression is None


def test_compression_on_one_worker_says_it_does_nothing(caplog):
  """One worker sends nothing to compress (its local replicas average
  exactly): accepted, as a script run alone before a cluster run is, but
  said, rather than logging "averaging in int4" alone."""
  with caplog.at_level("WARNING"):
    oscars_tf.OscarsStrategy(compression="int4")
    oscars_tf.OscarsStrategy()
  said = [r.getMessage() for r in caplog.records
          if "does nothing on one worker" in r.getMessage()]
  assert said == ["oscars_tf: compression='int4' does nothing on one worker: "
                  "it compresses what workers send each other; local "
                  "replicas average exactly."]


def test_the_start_up_check_covers_the_compression():
  """Workers compressing differently would wait in other collectives until
  the timeout: the start-up signature tells them apart."""
  settings = startup.Settings(oscars_tf.schedules.Fixed(4), "local", "RING",
                              None, 1)
  variables = [tf.Variable(tf.ones([3]))]
  at = startup._SIGNATURE_NAMES.index("compression")  # pylint: disable=protected-access
  signatures = [startup.signature(variables, dataclasses.replace(
      settings, compression=c)) for c in (None, "int8", "int4")]
  assert len({s[at] for s in signatures}) == 3
  # Nothing else differs.
  assert len({tuple(s[:at] + s[at + 1:]) for s in signatures}) == 1


def test_the_peer_watch_aborts_once_when_a_peer_is_gone_and_not_after_stop():
  from oscars_tf.runtime import collective_watch  # pylint: disable=g-import-not-at-top
  gone = {"a:1": False, "b:2": False}
  aborted = threading.Event()
  messages = []

  def abort(message):
    messages.append(message)
    aborted.set()
  watch = collective_watch.PeerWatch(lambda: ["a:1", "b:2"], abort=abort,
                                     gone=lambda address: gone[address])
  watch.start()
  assert not aborted.wait(3 * collective_watch.CHECK_EVERY_S)
  gone["b:2"] = True
  assert aborted.wait(10), "a gone peer was not noticed"
  assert len(messages) == 1 and "b:2" in messages[0]
  # Stopped: a peer gone afterwards aborts nothing.
  aborted.clear()
  watch.start()
  watch.stop()
  gone["a:1"] = True
  assert not aborted.wait(3 * collective_watch.CHECK_EVERY_S)
