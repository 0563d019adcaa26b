"""The runtime's autograd room: graph-level helpers: split backward, recompute, in-place checks, step timing."""
