"""What the serving processes share above the engine: conversions between pdspec.v1 messages and
engine objects (router and workers), and a worker's registration, heartbeats and metrics."""
