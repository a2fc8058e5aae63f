"""pdspec prefill_worker package."""
