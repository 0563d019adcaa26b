"""The runtime's compile room: torch.compile of stage modules, split for zero-bubble backward."""
