"""One RPC for every key under a directory of the coordination service.

TensorFlow's coordination service answers GetKeyValueDir (every key and
value under "dir/"), but TensorFlow's Python API has no call for it: only
get, insert and delete of one key. The chief reading a round's arrivals key
by key spends one round trip a member (or a host); this reader asks the
service for the whole round in one, over gRPC (grpcio, which TensorFlow
depends on) with the service's own message layout (xla/tsl's
coordination_service.proto, field numbers as TensorFlow 2.21 ships them).

No TensorFlow import. A service that does not know the call (another
TensorFlow) answers UNIMPLEMENTED: the reader then says None for good, and
the caller reads key by key as before.
"""

import threading

_METHOD = "/tensorflow.CoordinationService/GetKeyValueDir"
_PACKAGE = "oscars_tf_kv_dir"  # a private pool: no clash with TF's messages


def _message_classes():
  """(request class, response class) of GetKeyValueDir, made from their
  descriptors: TensorFlow ships no Python module for them."""
  from google.protobuf import descriptor_pb2  # pylint: disable=g-import-not-at-top
  from google.protobuf import descriptor_pool  # pylint: disable=g-import-not-at-top
  from google.protobuf import message_factory  # pylint: disable=g-import-not-at-top
  string, bytes_, message = 9, 12, 11  # FieldDescriptorProto.Type
  optional, repeated = 1, 3
  proto = descriptor_pb2.FileDescriptorProto(
      name=f"{_PACKAGE}.proto", package=_PACKAGE, syntax="proto3")
  entry = proto.message_type.add(name="KeyValueEntry")
  entry.field.add(name="key", number=1, type=string, label=optional)
  entry.field.add(name="value", number=2, type=bytes_, label=optional)
  request = proto.message_type.add(name="GetKeyValueDirRequest")
  request.field.add(name="directory_key", number=1, type=string,
                    label=optional)
  response = proto.message_type.add(name="GetKeyValueDirResponse")
  response.field.add(name="directory_key", number=1, type=string,
                     label=optional)
  response.field.add(name="kv", number=2, type=message, label=repeated,
                     type_name=f".{_PACKAGE}.KeyValueEntry")
  pool = descriptor_pool.DescriptorPool()
  pool.Add(proto)
  return tuple(message_factory.GetMessageClass(
      pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
               for name in ("GetKeyValueDirRequest", "GetKeyValueDirResponse"))


class DirectoryReader:
  """Reads a directory of the coordination service at `address`
  ("host:port" of the task that hosts it)."""

  def __init__(self, address):
    self.address = address
    self.supported = True  # until the service says otherwise
    self._call = None
    self._lock = threading.Lock()

  def read(self, directory, timeout_s):
    """{key: value} of every key under `directory` + "/" now (no waiting),
    or None: the service cannot say (the caller reads key by key)."""
    if not self.supported:
      return None
    try:
      import grpc  # pylint: disable=g-import-not-at-top
    except ImportError:
      self.supported = False
      return None
    try:
      call, request = self._connect()
      response = call(request(directory_key=directory),
                      timeout=max(0.05, timeout_s))
    except grpc.RpcError as e:
      if e.code() == grpc.StatusCode.UNIMPLEMENTED:
        self.supported = False
      return None  # unreachable or slow: the key-by-key reads tell why
    return {e.key: e.value.decode("utf-8") for e in response.kv}

  def _connect(self):
    with self._lock:
      if self._call is None:
        import grpc  # pylint: disable=g-import-not-at-top
        request, response = _message_classes()
        channel = grpc.insecure_channel(self.address)
        self._call = (channel.unary_unary(
            _METHOD, request_serializer=request.SerializeToString,
            response_deserializer=response.FromString), request)
      return self._call
