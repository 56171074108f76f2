"""Workers in network namespaces of their own: real addresses, links that
can be shaped and cut (Linux).

A hub namespace holds a bridge; each worker's namespace has its own address
on a veth pair to it. Nothing connects the bridge to the machine's network:
the workers reach each other and nothing else. Creating them needs root
(CAP_NET_ADMIN) and `ip` (iproute2); shaping a link needs `tc`. Used by
`oscars-launch --network=emulated` (see `emulate`), by
benchmarks/fit_end_spread.py and by tests/test_netns.py. (netns.py is
another thing: the launcher's private loopback namespace.)

Each job's hub is a network stack of its own, so jobs running at once
cannot clash on addresses even on the same subnet; their names differ.
Imports no TensorFlow.
"""

import ctypes
import functools
import os
import re
import shutil
import subprocess
import uuid

# The launcher's subnet; tests/test_netns.py uses 10.213.77 and
# benchmarks/fit_end_spread.py 10.213.79 (distinct for readable logs only).
EMULATED_SUBNET = "10.214.0"
MAX_WORKERS = 254  # worker i is .(i + 1) on a /24; .255 is broadcast
_CLONE_NEWNET = 0x40000000  # <linux/sched.h>

# tc's rate units (tc(8), RATES): bits per second or bytes per second.
_RATE_UNITS = {
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30,
    "tibps": 8 * 2**40,
}
_RATE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([a-z]+)")
MIN_RATE = 8e3  # bits/s: below this, one packet takes seconds


class Unavailable(Exception):
  """This machine cannot emulate the network; the message says why, on one
  line."""


def parse_rate(text):
  """Bits per second of a tc rate such as 100mbit, 1gbit or 500kbit.

  Raises ValueError naming what is wrong. A unit is required (a bare number
  means bits to tc but reads as anything to a person).
  """
  m = _RATE.fullmatch(text.strip().lower())
  if m is None or m.group(2) not in _RATE_UNITS:
    raise ValueError(f"{text!r} is not a rate: give a number and a unit, "
                     "e.g. 100mbit, 1gbit, 500kbit (tc's units: bit, kbit, "
                     "mbit, gbit, or bps, kbps, mbps, gbps for bytes)")
  bits = float(m.group(1)) * _RATE_UNITS[m.group(2)]
  if bits < MIN_RATE:
    raise ValueError(f"{text!r} is below the least rate, 8kbit")
  return bits


def parse_bandwidth(text, num_workers):
  """One rate per worker, as given: one for all or a comma list, one each.

  Raises ValueError naming what is wrong.
  """
  rates = [r.strip() for r in text.split(",")]
  for r in rates:
    parse_rate(r)
  if len(rates) == 1:
    return rates * num_workers
  if len(rates) != num_workers:
    raise ValueError(f"{len(rates)} rates for {num_workers} workers: give "
                     "one rate for all workers or one per worker")
  return rates


def tbf(rate):
  """tc's words for a token bucket that holds a link to `rate`.

  The bucket holds 10 ms of traffic (32 KB at least: a few full packets),
  so a transfer's rate over more than a fraction of a second is `rate`; the
  queue holds up to 50 ms more before packets are dropped.
  """
  burst = max(32 * 1024, int(parse_rate(rate) / 8 * 0.010))
  return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


def ip(*args, check=True):
  """Runs `ip args`; raises CalledProcessError on failure if `check`."""
  return subprocess.run(["ip", *args], capture_output=True, text=True,
                        timeout=20, check=check)


@functools.cache
def _setns():
  setns = ctypes.CDLL(None, use_errno=True).setns
  setns.argtypes = [ctypes.c_int, ctypes.c_int]
  setns.restype = ctypes.c_int
  return setns


class WorkerNamespaces:
  """A hub namespace with a bridge, and one namespace per worker; worker i
  has address `address(i)` on its `eth0`, and the hub's end of its link is
  `h<i>`."""

  def __init__(self, n, subnet, prefix="oscars"):
    tag = uuid.uuid4().hex[:6]  # jobs running at once get their own names
    self.subnet = subnet
    self.hub = f"{prefix}_hub_{tag}"
    self.workers = [f"{prefix}_w{i}_{tag}" for i in range(n)]
    self.shaping = None  # the qdisc on worker 0's link, once shaped
    self.created = []
    self.fds = {}  # name -> open namespace, once detached

  def address(self, i):
    return f"{self.subnet}.{i + 1}"

  def create(self):
    ip("netns", "add", self.hub)
    self.created.append(self.hub)
    ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
    ip("-n", self.hub, "link", "set", "br0", "up")
    for i, ns in enumerate(self.workers):
      ip("netns", "add", ns)
      self.created.append(ns)
      ip("-n", ns, "link", "set", "lo", "up")
      ip("-n", self.hub, "link", "add", f"h{i}", "type", "veth", "peer",
         "name", "eth0", "netns", ns)
      ip("-n", self.hub, "link", "set", f"h{i}", "master", "br0")
      ip("-n", self.hub, "link", "set", f"h{i}", "up")
      ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
      ip("-n", ns, "link", "set", "eth0", "up")

  def shape(self, qdisc, download=False):
    """Puts a qdisc on every worker's link; returns None, or why tc refused.

    `qdisc` is tc's words, e.g. ["tbf", "rate", "100mbit", ...], for every
    worker, or a list of them, one per worker. It goes on the worker's
    `eth0`, limiting what the worker sends; with `download`, also on the
    hub's end `h<i>`, limiting what it receives.
    """
    one = isinstance(qdisc[0], str)
    qdiscs = [qdisc] * len(self.workers) if one else qdisc
    for i, (ns, words) in enumerate(zip(self.workers, qdiscs)):
      ends = [(ns, "eth0")] + ([(self.hub, f"h{i}")] if download else [])
      for space, dev in ends:
        out = subprocess.run(["tc", "-n", space, "qdisc", "add", "dev", dev,
                              "root", *words],
                             capture_output=True, text=True, timeout=20)
        if out.returncode:
          return out.stderr.strip() or f"tc exited with {out.returncode}"
    self.shaping = " ".join(qdiscs[0])
    return None

  def cut(self, i):
    """Takes worker i's link down."""
    ip("-n", self.hub, "link", "set", f"h{i}", "down")

  def detach(self):
    """Holds every namespace by an open file instead of its name.

    Once the names are gone (`ip netns list` shows none), a namespace lives
    as long as this process holds it or a process runs in it: a launcher
    killed by SIGKILL, whose workers the kernel kills too, leaves nothing
    behind. Namespaces are then entered with `enter(i)`; `shape` and `cut`
    need the names, so they come first.
    """
    for ns in self.created:
      self.fds[ns] = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    self._delete_names()

  def enter(self, i):
    """A Popen preexec_fn that moves the child into worker i's namespace
    (setns(2)); after `detach`. Its pid, process group and parent stay."""
    fd, setns = self.fds[self.workers[i]], _setns()

    def preexec():
      if setns(fd, _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns into the worker's network")
    return preexec

  def remove(self):
    """Deletes the namespaces (those still held by running processes go
    when those end)."""
    for fd in self.fds.values():
      os.close(fd)
    self.fds = {}
    self._delete_names()

  def _delete_names(self):
    for ns in reversed(self.created):
      ip("netns", "del", ns, check=False)
    self.created = []


def emulate(num_workers, rates=None, prefix=None):
  """Worker namespaces for `oscars-launch --network=emulated`, detached.

  `rates`: None (links not shaped) or one tc rate per worker; each worker's
  link then gets tbf at its rate both ways. Raises Unavailable where the
  machine refuses (no root, no `ip` or `tc`, no tbf), having removed what
  it made.
  """
  if os.geteuid() != 0:
    raise Unavailable("needs root (CAP_NET_ADMIN) to create network "
                      "namespaces")
  for tool in ("ip",) + (("tc",) if rates else ()):
    if shutil.which(tool) is None:
      raise Unavailable(f"needs `{tool}` (iproute2), not found on PATH")
  spaces = WorkerNamespaces(num_workers, EMULATED_SUBNET,
                            prefix=prefix or f"oscars_launch{os.getpid()}")
  try:
    spaces.create()
    if rates:
      why = spaces.shape([tbf(r) for r in rates], download=True)
      if why is not None:
        raise Unavailable(f"tc refused a tbf qdisc: {why}")
    spaces.detach()
  except (subprocess.CalledProcessError, subprocess.TimeoutExpired,
          OSError) as e:
    spaces.remove()
    why = (getattr(e, "stderr", None) or str(e)).strip()
    raise Unavailable(f"cannot create network namespaces: {why}") from None
  except Unavailable:
    spaces.remove()
    raise
  return spaces


def one_line(text):
  """`text` with its whitespace runs (newlines too) as single spaces."""
  return " ".join(str(text).split())
