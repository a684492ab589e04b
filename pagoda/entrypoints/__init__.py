"""The composition root: the `pagoda` command line and the wiring behind each subcommand.

- `cli`: `main`, the top parser and `pagoda generate`.
- `engine_args`: the engine flags, generated from `pagoda.config.EngineArgs`'s fields.
- `serve`: `pagoda serve`, which wires logging, API keys, the app, operations and the server.
- `bench`: `pagoda bench throughput | latency | serve`, the flags and the glue to `pagoda.bench`.

Nothing else in `pagoda` imports this package: it sits above every layer.
"""
