"""One module per loop feature; each implements the checkpoints of `Policy`."""
