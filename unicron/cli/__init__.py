"""The `unicron` command line: one module per group of subcommands (top layer)."""
