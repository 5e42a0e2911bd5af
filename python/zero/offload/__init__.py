"""offload: host and disk placement of parameters and optimizer states."""
