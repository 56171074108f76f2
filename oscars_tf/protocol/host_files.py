"""A job's files on a host, its user's alone (host_relay.py, host_arrivals.py).

Shared memory is shared by every user of the host: in it, another user
could create a later round's file before the job does, to block its write
or to forge a decision or a row. So each host of a job keeps its files in
a directory of its own, made 0700, and writes them 0600; a directory or
file that is not the job's user's own, not of its kind (a link, a FIFO) or
open to other users is not trusted (Untrusted): the relay then stops using
files, and its workers read and post through the store as without one.
No TensorFlow.
"""

import errno
import glob
import os
import shutil
import stat


class Untrusted(Exception):
  """A host file or directory that is not the job's user's alone."""


def problem(status, kind):
  """Why a `kind` ("file" or "directory") of os.stat `status` is not to be
  trusted, or None."""
  is_kind = stat.S_ISDIR if kind == "directory" else stat.S_ISREG
  if not is_kind(status.st_mode):
    return f"not a {kind}"
  if status.st_uid != os.geteuid():
    return (f"owned by uid {status.st_uid}, not this job's user "
            f"({os.geteuid()})")
  if status.st_mode & 0o077:
    return f"mode {stat.S_IMODE(status.st_mode):04o}, open to other users"
  return None


def check_directory(path):
  """Untrusted unless `path` is the job's user's own 0700 directory;
  FileNotFoundError where there is none yet."""
  why = problem(os.lstat(path), "directory")
  if why:
    raise Untrusted(f"{path}: {why}")


def make_directory(path):
  """`path`, made 0700 unless there; Untrusted as check_directory."""
  try:
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)  # whatever the umask
  except FileExistsError:
    pass
  check_directory(path)


def read(path):
  """The text of `path`; FileNotFoundError where there is none; Untrusted
  where it is not the job's user's own regular file."""
  try:
    # No link followed; a FIFO does not block the open (it is refused).
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise Untrusted(f"{path}: a symbolic link") from None
    raise
  with os.fdopen(fd, encoding="ascii") as f:
    why = problem(os.fstat(fd), "file")
    if why:
      raise Untrusted(f"{path}: {why}")
    return f.read()


def write(path, text, temporary):
  """`text` into `path`, 0600, atomically (written to `temporary`, then
  renamed)."""
  fd = os.open(temporary,
               os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
  with os.fdopen(fd, "w", encoding="ascii") as f:
    os.fchmod(fd, 0o600)  # whatever the umask
    f.write(text)
  os.replace(temporary, path)


def remove_older_than(pattern, when):
  """Removes what matches `pattern` (files, directories) and is this
  user's, last changed before `when` (time.time()); other users' stay."""
  for path in glob.glob(pattern):
    try:
      status = os.lstat(path)
      if status.st_uid != os.geteuid() or status.st_mtime >= when:
        continue
      if stat.S_ISDIR(status.st_mode):
        shutil.rmtree(path)  # follows no link inside
      else:
        os.remove(path)
    except OSError:
      pass  # another leader removed it


def remove_directory(path):
  shutil.rmtree(path, ignore_errors=True)
