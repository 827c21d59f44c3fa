"""The token bus: typed wire messages, the client and its router, CURVE authentication, and the
engine server (transport, generation gate) with its launcher. Nothing here imports the rest of rollout/."""
