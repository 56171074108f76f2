"""Files of saved states that survive a power loss, and names that stay in
their directory.

A saved state is files named by a small JSON file (checkpoint.py's
`last.json`, round_state.py's `round-w<i>.json`), written in this order:
each file to a temporary name, flushed to disk (`fsync`) and renamed into
place, the JSON file last; then the directory itself is flushed, so the
renames are on disk; only then are superseded files deleted. A power loss
at any point leaves the JSON file naming complete files on disk.

The names inside a JSON file are read back as plain file names in its
directory: an absolute path or one with a directory part (`../x`) would
make a restore read, or the next save delete, a file elsewhere (as root
when the launcher runs with --cpu_limit or an emulated network).

A save killed midway leaves its temporary files (`temp_prefix`); the next
save of the same kind, or the next restore, removes them (`remove_temps`).
"""

import contextlib
import os
import re

import numpy as np

from oscars_tf.errors import OscarsError


class SavedStateError(OscarsError):
  """A saved state's JSON file names a file outside its directory."""


# A save's temporary files: `.tmp-<pid>.<ext>` (a checkpoint's) and
# `.tmp-round-w<worker>-<pid>.<ext>` (a worker's round state's).
_TEMP = re.compile(r"\.tmp-(?:round-w(\d+)-)?\d+\.(?:weights\.h5|npz|json)")

CHECKPOINT = "checkpoint"    # remove_temps: the chief's checkpoint's
EVERY_SAVE = "every save"    # remove_temps: a checkpoint's and every worker's


def temp_prefix(directory, worker=None):
  """The path, less its extension, of this process's temporary files in
  `directory`: a checkpoint's, or (given `worker`) its round state's."""
  kind = "" if worker is None else f"round-w{int(worker)}-"
  return os.path.join(directory, f".tmp-{kind}{os.getpid()}")


def remove_temps(directory, of):
  """Deletes the temporary files that saves killed midway left in
  `directory`, of `of`: a worker index (its round state's: only it saves
  them), CHECKPOINT (only the chief saves checkpoints), or EVERY_SAVE (at a
  restore, when nobody saves). Any other file stays, whatever its name."""
  names = os.listdir(directory) if directory and os.path.isdir(
      directory) else []
  for name in names:
    match = _TEMP.fullmatch(name)
    if match is None:
      continue
    worker = match.group(1)
    if (of == EVERY_SAVE or (worker is None and of == CHECKPOINT) or
        (worker is not None and of == int(worker))):
      # Another worker restoring from a shared directory may remove it
      # first.
      with contextlib.suppress(FileNotFoundError, IsADirectoryError):
        os.remove(os.path.join(directory, name))


def fsync(path):
  """Flushes the file, or the directory's entries (its renames), at `path`
  to disk."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def replace(tmp, path):
  """Renames the written file `tmp` to `path` once it is on disk."""
  fsync(tmp)
  os.replace(tmp, path)


def plain_name(name, source):
  """`name` if it is a plain file name (no directory part, not `.` or
  `..`), else SavedStateError naming `source` (the JSON file it came
  from)."""
  if (not isinstance(name, str) or not name or name in (".", "..") or
      os.path.basename(name) != name or "/" in name or "\\" in name):
    raise SavedStateError(
        f"oscars_tf: {source} names {name!r}, which is not a file name in "
        "its directory; a saved state names only its own files (was the "
        "file edited?).")
  return name


def check_names(state, source):
  """`state` (a saved state's JSON dict) if the files it names are plain
  names (see `plain_name`), else SavedStateError."""
  for key in ("weights", "outer"):
    if state.get(key) is not None:
      plain_name(state[key], source)
  return state


def write_outer_npz(sets, path, tmp):
  """Writes outer optimizer state `sets` (see `OscarsStrategy.outer_state`)
  to `path` through `tmp` and an atomic rename."""
  with open(tmp, "wb") as f:
    np.savez(f, **_to_npz_dict(sets))
  replace(tmp, path)


def _to_npz_dict(sets):
  """[(starts, momenta)] per set -> flat {name: array} for np.savez."""
  out = {}
  for j, (starts, momenta) in enumerate(sets):
    out.update({f"{j}.start.{i}": a for i, a in enumerate(starts)})
    out.update({f"{j}.momentum.{i}": a for i, a in enumerate(momenta)})
  return out


def read_outer_npz(path):
  """The outer optimizer state `write_outer_npz` wrote to `path`."""
  with np.load(path) as saved:
    return _from_npz_dict({k: saved[k] for k in saved.files})


def _from_npz_dict(arrays):
  """The inverse of `_to_npz_dict`."""
  sets = {}
  for name in arrays:
    j, kind, i = name.split(".")
    sets.setdefault(int(j), {"start": {}, "momentum": {}})[kind][int(i)] = (
        arrays[name])
  return [tuple([parts[kind][i] for i in sorted(parts[kind])]
                for kind in ("start", "momentum"))
          for _, parts in sorted(sets.items())]
