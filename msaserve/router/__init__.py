"""Router: KV-aware replica choice as a Ray Serve RequestRouter, with prefix and session state."""
