"""metropolis package."""
