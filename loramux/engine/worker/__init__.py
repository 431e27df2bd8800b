"""The worker: the model on the device (loading, the runner, compile, CUDA graphs, kernel warm-up,
the KV cache) and sampling."""
