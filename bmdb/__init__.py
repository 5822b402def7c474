"""bmdb package."""
