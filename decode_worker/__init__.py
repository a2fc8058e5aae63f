"""pdspec decode_worker package."""
