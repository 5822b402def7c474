"""shepherd package."""
