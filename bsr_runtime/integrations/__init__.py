"""Integrations with engines and cache libraries, each in a subpackage of its own (the only
importer of that engine or library)."""
