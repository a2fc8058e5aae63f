"""pdspec kvtransfer package."""
