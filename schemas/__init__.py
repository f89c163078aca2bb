"""pydantic v2 wire models (imports only pydantic)."""
