"""Aeron-compatible UDP transport. Sans-IO except for the one socket module."""
