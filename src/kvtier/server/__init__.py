"""The store daemon (one store shared by several processes) and its client."""
