"""Credit policies and queue overflow policies: pure functions of quota, connections and usage."""
