"""The flowbroker daemon: listeners, connections, exchanges, queues with watermarks, delivery, admin, CLI."""
