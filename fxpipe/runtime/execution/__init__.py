"""The runtime's execution room: one rank's schedule: the driver, a stage, its actions, per-step state, routes and receives."""
