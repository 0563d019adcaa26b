"""The runtime's numerics room: numerical behaviour: loss probing and checks, BatchNorm, the caller's autocast."""
