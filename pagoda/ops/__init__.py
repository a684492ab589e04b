"""Layer 6, control and ops: Prometheus metrics (`metrics`), request lifecycle events
(`request_events`), logs (`logs`), the periodic status line (`status`), optional tracing
(`tracing`), and `server_ops`, which puts them and /metrics, /ready, /load and request timelines
onto a server. See docs/operations.md."""
