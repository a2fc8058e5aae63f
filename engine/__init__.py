"""pdspec engine package."""
