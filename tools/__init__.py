"""Tooling around the serving stack, never imported by it: EAGLE3 self-distillation and training,
speculative evaluation (`pdspec bench spec`), the load generator (`pdspec bench serve`), and the
Helm chart's schema generator and helm binary finder."""
