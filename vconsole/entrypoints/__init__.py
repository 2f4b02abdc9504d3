"""Servers that put a standard API in front of the engine process."""
