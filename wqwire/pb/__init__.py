"""Generated protobuf and gRPC stubs for wq.v1 (``make proto``; do not edit)."""
