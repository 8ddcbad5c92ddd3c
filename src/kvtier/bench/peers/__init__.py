"""Other KV caches run beside kvtier in the serving benchmark (peers), each in its own venv."""
