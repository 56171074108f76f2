"""Workers in network namespaces of their own: real addresses, links that
can be shaped and cut.

A hub namespace holds a bridge; each worker's namespace has its own address
on a veth pair to it. Creating them needs root (CAP_NET_ADMIN) and `ip`
(iproute2); shaping a link needs `tc`. Used by benchmarks/fit_end_spread.py
(its slow_links profile) and tests/test_netns.py, each on a subnet of its
own. (oscars_tf/netns.py is another thing: the launcher's private loopback
namespace.)
"""

import subprocess
import uuid


def ip(*args, check=True):
  """Runs `ip args`; raises CalledProcessError on failure if `check`."""
  return subprocess.run(["ip", *args], capture_output=True, text=True,
                        timeout=20, check=check)


class WorkerNamespaces:
  """A hub namespace with a bridge, and one namespace per worker; worker i
  has address `address(i)` on its `eth0`."""

  def __init__(self, n, subnet, prefix="oscars"):
    tag = uuid.uuid4().hex[:6]  # jobs running at once get their own names
    self.subnet = subnet
    self.hub = f"{prefix}_hub_{tag}"
    self.workers = [f"{prefix}_w{i}_{tag}" for i in range(n)]
    self.shaping = None  # the qdisc on every worker's link, once shaped
    self.created = []

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

  def shape(self, qdisc):
    """Puts `qdisc` (tc's words, e.g. ["tbf", "rate", "100mbit", ...]) on
    every worker's link; returns None, or why tc refused."""
    for ns in self.workers:
      out = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add",
                            "dev", "eth0", "root", *qdisc],
                           capture_output=True, text=True, timeout=20)
      if out.returncode:
        return out.stderr.strip() or f"tc exited with {out.returncode}"
    self.shaping = " ".join(qdisc)
    return None

  def cut(self, i):
    """Takes worker i's link down."""
    ip("-n", self.hub, "link", "set", f"h{i}", "down")

  def remove(self):
    for ns in reversed(self.created):
      ip("netns", "del", ns, check=False)
    self.created = []
