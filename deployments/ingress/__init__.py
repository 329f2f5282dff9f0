"""The ingress process: the FastAPI app and its routes' binding (ingress.py, http_app.py,
operation_routes.py), the engine client and a request's way through it (engine_client.py,
request_flow.py, migration.py, streams.py), admission, tracing, metrics, health, per-key rate limits, and the Batch
API's store, runner and routes. docs/architecture.md, "The rooms"."""
