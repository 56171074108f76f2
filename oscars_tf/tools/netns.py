"""A private network namespace for local jobs (Linux).

TensorFlow's gRPC server listens on every interface (0.0.0.0:port) whatever
address the cluster names, and the cluster's RPCs are unauthenticated:
anyone who can reach the port can run ops in a worker. oscars-launch
therefore runs a local job in a network namespace of its own, whose only
interface is loopback: the listeners exist only there, unreachable from
outside the machine (and from other jobs on it). The price: the workers
have no network, so data sets that download need the files in place first,
or --network=host. Only a loopback --host has an address there: isolated
refuses any other, and auto runs it on the machine's network with a warning
(where_to_run).

Imports no TensorFlow; needs `unshare` (util-linux) and either root or
unprivileged user namespaces.
"""

import fcntl
import ipaddress
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


def where_to_run(network, host):
  """For --network=`network` (isolated, auto or host) and --host=`host`:
  (whether the job is to run in a private namespace, a warning line or
  None). A private namespace has loopback only, so a host that is not
  loopback is refused by isolated and run on the machine's network by auto,
  with the warning. ValueError, one line naming the host, for a host the
  mode cannot use."""
  try:
    loopback = is_loopback(host)
  except ValueError as e:
    raise ValueError(f"--host={host}: {e}.") from None
  if network == "host":
    return False, None
  if loopback:
    return True, None
  if network == "isolated":
    raise ValueError(
        f"--network=isolated: --host={host} is not a loopback address, and "
        "the job's private network namespace has loopback only; use "
        "--host=127.0.0.1 (or localhost), or --network=host on a private, "
        "firewalled network.")
  return False, (
      f"--host={host} is not a loopback address, so the job runs on this "
      "machine's network, where TensorFlow's unauthenticated gRPC servers "
      "listen on all interfaces (0.0.0.0). Firewall the ports, or pass "
      "--network=host to silence this.")


def is_loopback(host):
  """Whether `host` is this machine's loopback, which a private namespace
  has too: an address in 127.0.0.0/8, or a name (localhost) that resolves
  only to such addresses. ValueError for a host no worker could listen on:
  an IPv6 address (the launcher's ports and TF_CONFIG are IPv4), or a name
  that does not resolve to IPv4."""
  try:
    literal = ipaddress.ip_address(host.strip("[]"))
  except ValueError:
    literal = None  # a name
  if literal is not None and literal.version == 6:
    raise ValueError("IPv6 addresses are not supported (the workers' ports "
                     "and TF_CONFIG are IPv4); use --host=127.0.0.1 or "
                     "localhost")
  try:
    found = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
  except (socket.gaierror, UnicodeError) as e:
    raise ValueError(f"does not resolve to an IPv4 address ({e})") from None
  return bool(found) and all(
      ipaddress.ip_address(address[0]).is_loopback for *_, address in found)


def check_listens(host):
  """ValueError, one line, where no worker could listen on `host` (an
  address of another machine)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    try:
      s.bind((host, 0))
    except OSError as e:
      raise ValueError(f"--host={host}: cannot listen there "
                       f"({e.strerror or e}); give an address of this "
                       "machine.") from None


def bring_up_loopback():
  """Sets `lo` up (a new namespace starts with it down)."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    request = struct.pack("16sh", b"lo", 0)
    flags = struct.unpack("16sh", fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
    fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def interfaces():
  """Names of this namespace's network interfaces."""
  return sorted(name for _, name in socket.if_nameindex())
