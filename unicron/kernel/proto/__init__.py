"""Generated gRPC/protobuf code of the coordinator's API (``coordinator.proto``).

Do not edit the ``*_pb2*`` files: change ``coordinator.proto`` and run ``scripts/gen_proto.sh``.
"""
