"""The runtime's gradients room: gradient sums over replicas: bucketed allreduce, trainable-set checks."""
