"""pdspec deploy package."""
