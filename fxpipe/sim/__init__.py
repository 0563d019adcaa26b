"""Exact event simulation of (plan, chain, schedule): stage costs, iteration timelines, Chrome traces, stragglers."""
