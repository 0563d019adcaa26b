"""The runtime's faults room: the floor everything uses: errors, failure propagation, stalls, guards, preemption."""
