"""The shared kernel: records, errors, etcd access, logging, settings, wire formats, protocol messages,
the severity table. It imports nothing else of this project."""
