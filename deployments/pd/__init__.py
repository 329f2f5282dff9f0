"""PD orchestration, in the ingress's process: how a request reaches the engines (backends.py:
colocated, or P then D), where its prompt is computed (disaggregation.py), the watch of D
(decode_watch.py), the KV connector and its transports (kv_connector.py, kv_direct.py), the engine
deployments' request router (routing.py) and the rate-matched planner (pd_planner.py).
docs/architecture.md, "The rooms"."""
