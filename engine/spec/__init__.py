"""Speculative decoding: proposers (EAGLE3, n-gram), verification by rejection sampling.

It lives in engine/ rather than decode_worker/ because the prefill worker runs the EAGLE3
draft's prefill too (the draft KV travels with the target KV), so the draft is shared model code.
"""
