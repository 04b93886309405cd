"""Shared fixtures for the flowbroker test suite."""
