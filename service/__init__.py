"""nnetc HTTP service (FastAPI) and command line; the only place engine and web stack meet."""
