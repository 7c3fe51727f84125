"""Unicron: a self-healing workload manager for LLM training (see docs/architecture.md)."""

import os

# Before anything imports grpc (it reads this at import): our processes that run gRPC threads (the
# etcd client) also fork children with a pre-exec hook (the agent's ranks, sidecars and marker, for
# PDEATHSIG). gRPC's fork handlers restart its threads in the child, where close_fds then closes
# their descriptors before exec: "epoll_wait error: Bad file descriptor", sometimes SIGABRT. No child
# of ours uses gRPC before it execs, so the handlers are not needed. Agents' children inherit it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
