"""Plain data below everything else: plans, cost graphs and chains, schedules, clusters, meta keys (no runtime, no planner)."""
