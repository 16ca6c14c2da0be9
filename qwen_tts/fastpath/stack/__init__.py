"""The opt-in persistent stack kernel: one launch runs a whole decoder stack for a one-token pass."""
