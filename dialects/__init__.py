"""The HTTP dialects: each module turns its own request shape into the one internal request
(engine.request.GenerationRequest) and the engine's outputs back into its own shapes and events.
Nothing here imports Ray or deployments/ (tests/test_dialects_imports.py checks it)."""
