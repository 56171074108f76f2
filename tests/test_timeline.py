"""Each worker's timeline (observability/summaries.py): written where its
summaries go, at `fit`'s end or else at exit, and merged into one trace."""

import dataclasses
import json
import types

import tensorflow as tf

from oscars_tf.distribute import epochs
from oscars_tf.observability import summaries
from oscars_tf.protocol import round_history


def _record(round_):
  names = [f.name for f in dataclasses.fields(round_history.RoundRecord)]
  values = dict.fromkeys(names, 0)
  values.update(round=round_, arrived_at=100.0 + round_, compute_s=0.5,
                comm_s=0.1, divergence=float("nan"), plan="p")
  return round_history.RoundRecord(**values)


def test_a_timeline_goes_where_the_summaries_go_a_bucket_too(
    tmp_path, monkeypatch):
  """A log directory may be a bucket (gs://, s3://; here TensorFlow's
  in-memory file system), as the summaries allow. Before, the timeline
  went through the local file system: ./gs:/bucket/... on local disk."""
  monkeypatch.chdir(tmp_path)
  logdir = "ram://oscars-timeline/run"
  for worker in (0, 1):
    path = summaries.write_timeline(logdir, [_record(0), _record(1)], worker)
    assert path == f"{logdir}/timeline_worker_{worker}.json"
  assert not list(tmp_path.iterdir())  # nothing on local disk
  out, skipped = summaries.merge_timelines(logdir)
  assert skipped == []
  with tf.io.gfile.GFile(out) as f:
    merged = json.load(f)["traceEvents"]
  assert {e["tid"] for e in merged if e["ph"] == "X"} == {0, 1}


def test_merging_leaves_out_an_unreadable_file_and_names_it(tmp_path, capsys):
  """One truncated or foreign file no longer loses the others' merge, nor
  hides which file it was."""
  summaries.write_timeline(str(tmp_path), [_record(0)], 0)
  (tmp_path / "timeline_worker_1.json").write_text('{"traceEvents": [')
  (tmp_path / "timeline_worker_2.json").write_text('{"other": 1}')
  assert summaries.main(["summaries", "merge", str(tmp_path)]) == 0
  out, err = capsys.readouterr()
  assert out.strip() == str(tmp_path / "timeline.json")
  lines = err.strip().split("\n")
  assert len(lines) == 2, err
  assert lines[0].startswith("summaries merge: left out timeline_worker_1."
                             "json: ")
  assert lines[1] == ("summaries merge: left out timeline_worker_2.json: no "
                      "'traceEvents'")
  merged = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
  assert {e["tid"] for e in merged} == {0}


def test_a_worker_whose_fit_did_not_end_writes_its_timeline_at_exit(
    tmp_path, monkeypatch):
  """`fit` writes the timeline at its end; a `fit` that raised (Keras
  skips on_train_end) or a custom loop that never called
  `write_timeline` left none. The exit handler writes it, once."""
  monkeypatch.setattr(epochs.gc, "freeze", lambda: None)
  book = types.SimpleNamespace(history=round_history.RoundHistory(3),
                               plan=None, observer=None)
  cluster = types.SimpleNamespace(worker_index=2, is_chief=False)
  logs = summaries.RoundLogging(cluster, book)
  logs.set_logdir(str(tmp_path))
  book.history.append(_record(0))
  logs.finish_logs()  # fit's end
  timeline = tmp_path / "timeline_worker_2.json"
  written = timeline.stat().st_mtime_ns
  book.history.append(_record(1))  # a round after it, then an error
  epochs.teardown_quickly(logs)
  rounds = {e["args"]["round"] for e in json.loads(timeline.read_text())[
      "traceEvents"] if e["ph"] == "X"}
  assert rounds == {0, 1}
  written = timeline.stat().st_mtime_ns
  epochs.teardown_quickly(logs)  # nothing new: not written again
  assert timeline.stat().st_mtime_ns == written
