"""The runtime's calibration room: measuring this machine: links, collectives, overlap, fixed per-action costs, topology."""
