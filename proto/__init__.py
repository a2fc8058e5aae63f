"""pdspec proto package."""
