"""A private network namespace for local jobs (Linux).

TensorFlow's gRPC server listens on every interface (0.0.0.0:port) whatever
address the cluster names, and the cluster's RPCs are unauthenticated:
anyone who can reach the port can run ops in a worker. oscars-launch
therefore runs a local job in a network namespace of its own, whose only
interface is loopback: the listeners exist only there, unreachable from
outside the machine (and from other jobs on it). The price: the workers
have no network, so data sets that download need the files in place first,
or --network=host.

Imports no TensorFlow; needs `unshare` (util-linux) and either root or
unprivileged user namespaces.
"""

import fcntl
import os
import shutil
import socket
import struct
import subprocess

ENV = "OSCARS_LAUNCH_NETNS"  # set inside the namespace
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def unshare_command():
  """The command prefix that runs a program in a fresh network namespace
  (as root, or mapped to root in a user namespace), or None where this
  machine does not allow one."""
  tool = shutil.which("unshare")
  if tool is None:
    return None
  prefix = [tool, "--net"] + ([] if os.geteuid() == 0 else
                              ["--map-root-user"])
  try:
    probe = subprocess.run(prefix + ["true"], capture_output=True, timeout=10)
  except (OSError, subprocess.TimeoutExpired):
    return None
  return prefix if probe.returncode == 0 else None


def bring_up_loopback():
  """Sets `lo` up (a new namespace starts with it down)."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    request = struct.pack("16sh", b"lo", 0)
    flags = struct.unpack("16sh", fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
    fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def interfaces():
  """Names of this namespace's network interfaces."""
  return sorted(name for _, name in socket.if_nameindex())
