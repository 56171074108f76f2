"""What a worker that exits with code 75 tells its launcher.

Exit code 75 says only that a worker lost a peer or the job. A worker whose
averaging collective failed because a member was killed is that death's
survivor: the launcher restarts the job so it resumes from the survivors'
round states. Any other 75 (a worker cut off on its own, one that found
training over) is a lone loss the others train past. The worker writes the
members of its failed collective to a note the launcher reads, so that one
death, dropped cleanly, does not make every later 75 look like its
survivor. No note (a worker older than this, or killed while writing):
the launcher assumes the worst, as before notes existed.
"""

import json
import os

ENV = "OSCARS_EXIT_NOTES"  # the directory, set by the launcher


def _task_index():
  config = json.loads(os.environ.get("TF_CONFIG") or "{}")
  return int(config.get("task", {}).get("index", 0))


def write(peers):
  """Notes this worker's exit 75: `peers`, the workers of the collective
  that failed (None: the protocol lost a peer or the job, no collective)."""
  directory = os.environ.get(ENV)
  if not directory:
    return
  path = os.path.join(directory, f"worker-{_task_index()}.json")
  try:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      json.dump({"peers": None if peers is None else sorted(peers)}, f)
    os.replace(path + ".tmp", path)
  except OSError:
    pass  # the launcher then assumes the worst


def read(directory, index):
  """The peers of worker `index`'s failed collective: a list, [] for a loss
  outside any collective, or None when it left no note."""
  try:
    with open(os.path.join(directory, f"worker-{index}.json"),
              encoding="utf-8") as f:
      peers = json.load(f)["peers"]
  except (OSError, ValueError, KeyError, TypeError):
    return None
  return [] if peers is None else [int(p) for p in peers]
