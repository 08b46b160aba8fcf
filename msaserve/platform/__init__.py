"""Public face: ServeConfig, the Ray Serve app builder, the OpenAI-compatible API, CLI, metrics."""
