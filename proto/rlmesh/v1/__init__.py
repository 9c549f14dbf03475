"""Generated protobuf and gRPC code for rlmesh.v1 (see scripts/gen_proto.sh)."""
