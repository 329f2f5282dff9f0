"""What runs in an engine replica: the P, D and colocated servers (servers.py), their output
channels (output_channels.py), liveness heartbeats and watches (liveness.py), the load each
measures (load_meter.py), the LoRA store and caches (lora_store.py), the embeddings deployment
(embeddings.py), and the autoscaling policies Serve's controller calls (autoscaling.py).
docs/architecture.md, "The rooms"."""
