"""Developer tools for the deployment artifacts (Helm chart schema, the helm binary)."""
