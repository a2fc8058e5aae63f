"""The worker roles: the `role` a worker registers with, and the deployment schema's sections."""

WORKER_ROLES = ("prefill", "decode", "aggregated")
