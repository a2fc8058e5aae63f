"""pdspec router package."""
