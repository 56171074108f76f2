"""oscars-launch --network and --host: isolated isolates or refuses, auto
warns when it cannot isolate (issue 43, item 4). The launcher imports no
TensorFlow; its workers here are `python -c` one-liners."""

import os
import subprocess
import sys

import pytest

from oscars_tf.tools import netns

LAUNCH = [sys.executable, "-m", "oscars_tf.cli.launch"]
# The worker says which network namespace it is in, and which interfaces.
NAMESPACE_OF_WORKER = (
    "import os, socket; print('netns', os.stat('/proc/self/ns/net').st_ino, "
    "sorted(n for _, n in socket.if_nameindex()))")


def _launch(args, code, timeout=60):
  return subprocess.run(
      LAUNCH + ["--num_workers=1", *args, "--", sys.executable, "-c", code],
      capture_output=True, text=True, timeout=timeout, check=False)


def _errors(stderr):
  return [line for line in stderr.splitlines()
          if line.startswith("oscars-launch: error:")]


def _needs_namespaces():
  if not os.path.exists("/proc/self/ns/net"):
    pytest.skip("no /proc/self/ns/net to compare namespaces by")
  if netns.unshare_command() is None:
    pytest.skip("this machine allows no private network namespace "
                "(unshare with root or user namespaces)")


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_isolated_puts_a_loopback_hosts_workers_in_a_namespace_of_their_own(
    host):
  """Before: --host=localhost ran the worker in the launcher's own
  namespace, on the machine's network, with exit code 0."""
  _needs_namespaces()
  proc = _launch(["--network=isolated", f"--host={host}"],
                 NAMESPACE_OF_WORKER)
  assert proc.returncode == 0, proc.stderr
  inode, ifaces = proc.stdout.split("netns ", 1)[1].split(" ", 1)
  assert int(inode) != os.stat("/proc/self/ns/net").st_ino
  assert ifaces.strip() == "['lo']"


@pytest.mark.parametrize("host, says", [
    ("192.0.2.1", "not a loopback address"),
    ("::1", "IPv6"),
])
def test_isolated_refuses_a_host_it_cannot_isolate(host, says, tmp_path):
  """One error line naming the host, a non-zero exit, no worker started."""
  started = tmp_path / "started"
  proc = _launch(["--network=isolated", f"--host={host}"],
                 f"open({str(started)!r}, 'w').close()")
  assert proc.returncode == 1, proc.stderr
  errors = _errors(proc.stderr)
  assert len(errors) == 1, proc.stderr
  assert f"--host={host}" in errors[0] and says in errors[0], errors[0]
  assert "Traceback" not in proc.stderr
  assert not started.exists()


def test_auto_warns_once_when_the_host_is_not_loopback():
  """auto cannot isolate a job on an address of the machine's network: it
  runs it there, saying so in one line. (The address is the machine's
  own, so that the workers can listen on it.)"""
  import socket  # pylint: disable=import-outside-toplevel
  try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
      s.connect(("10.255.255.1", 9))  # no packet sent: picks a route
      address = s.getsockname()[0]
  except OSError:
    pytest.skip("this machine has no non-loopback IPv4 address")
  if address.startswith("127."):
    pytest.skip("this machine has no non-loopback IPv4 address")
  proc = _launch([f"--host={address}"], "print('ran')")
  assert proc.returncode == 0 and "ran" in proc.stdout, proc.stderr
  warnings = [line for line in proc.stderr.splitlines()
              if "WARNING" in line]
  assert len(warnings) == 1, proc.stderr
  assert f"--host={address}" in warnings[0]
  assert "not a loopback address" in warnings[0]


def test_a_host_of_another_machine_is_one_clear_line(tmp_path):
  """--network=host on an address this machine does not have (192.0.2.1,
  TEST-NET-1, is no one's): one error line, not a traceback from binding
  its ports."""
  started = tmp_path / "started"
  proc = _launch(["--network=host", "--host=192.0.2.1"],
                 f"open({str(started)!r}, 'w').close()")
  assert proc.returncode == 1, proc.stderr
  errors = _errors(proc.stderr)
  assert len(errors) == 1 and "--host=192.0.2.1" in errors[0], (
      proc.stderr)
  assert "Traceback" not in proc.stderr and not started.exists()
