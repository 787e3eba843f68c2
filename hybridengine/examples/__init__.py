"""Example trainers built on HybridEngine (a trainer author's starting points)."""
