#!/usr/bin/env bash
# Regenerate the committed gRPC/protobuf modules of unicron/kernel/proto/ from coordinator.proto.
# Run after editing the .proto and commit the results; the pins of grpcio-tools/protobuf in
# requirements.txt decide the generated code's runtime requirements.
# Usage: scripts/gen_proto.sh [OUTDIR]   (default unicron/kernel/proto; the tests generate into a temp dir
# and compare, to catch generated code that is stale against the .proto)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-unicron/kernel/proto}
mkdir -p "$out"
.venv/bin/python -m grpc_tools.protoc -I unicron/kernel/proto \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  unicron/kernel/proto/coordinator.proto
# protoc writes a top-level import ("import coordinator_pb2"); make it package-relative.
sed -i 's/^import coordinator_pb2 as coordinator__pb2$/from unicron.kernel.proto import coordinator_pb2 as coordinator__pb2/' \
  "$out/coordinator_pb2_grpc.py"
grep -q '^from unicron.kernel.proto import coordinator_pb2 as coordinator__pb2$' "$out/coordinator_pb2_grpc.py" \
  || { echo "gen_proto: could not fix the import in coordinator_pb2_grpc.py; protoc's output changed" >&2; exit 1; }
echo "gen_proto: wrote coordinator_pb2.py, coordinator_pb2.pyi, coordinator_pb2_grpc.py to $out" >&2
