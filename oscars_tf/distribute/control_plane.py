"""A worker's control plane: round membership and the agreements between
rounds, over the key-value store of TensorFlow's coordination service."""

import dataclasses
from typing import Optional

from oscars_tf import cluster as cluster_lib
from oscars_tf.protocol import agreement
from oscars_tf.protocol import host_relay
from oscars_tf.protocol import membership as membership_lib
from oscars_tf.runtime import coordination_store
from oscars_tf.runtime import fault_injection


@dataclasses.dataclass(frozen=True)
class ControlPlane:
  membership: Optional[membership_lib.Membership]  # None: a single worker
  agreements: Optional[agreement.Agreements]


def connect(info, hosts, straggler_timeout, collective_timeout):
  """The control plane of worker `info` (`hosts`: each worker's host)."""
  if not info.is_multi_worker:
    return ControlPlane(None, None)
  # The chief reads each round's arrivals in directory reads (over gRPC).
  service = info.service_address if info.rpc_layer == "grpc" else None
  store = coordination_store.ContextStore(service)
  addresses = [a for _, _, a in info.workers]

  def is_gone(j):  # its server refuses connections: dropped at once
    return cluster_lib.connection_refused(addresses[j])
  relay = host_relay.HostRelay(hosts, info.worker_index) if (
      host_relay.HostRelay.wanted(hosts)) else None
  return ControlPlane(
      membership_lib.Membership(
          store, info.worker_index, info.num_workers, straggler_timeout,
          collective_timeout, is_gone=is_gone, relay=relay,
          hooks=fault_injection),  # test-only holds; unset, they do nothing
      agreement.Agreements(store, info.worker_index, straggler_timeout,
                           collective_timeout, is_gone=is_gone))
