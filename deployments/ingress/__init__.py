"""The ingress process: the FastAPI app built per replica and its routes' binding (ingress.py: the
one module here that binds to dialects/ routes), the operations routes' answers (operation_routes.py),
the engine client and a request's way through it (engine_client.py, which also maps the serving
system's failures to what a client is told; request_flow.py, migration.py, streams.py), admission,
tracing, metrics, health, per-key rate limits, and the Batch API's service, store and runner.
docs/architecture.md, "The rooms"."""
