"""Multi-turn episodes: environments that answer the model (protocol.py says how to write one)."""
