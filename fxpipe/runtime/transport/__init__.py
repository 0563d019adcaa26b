"""The runtime's transport room: messages and rows between stages: communication, batch layouts and shape tables."""
