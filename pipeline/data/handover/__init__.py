"""The hand-over, on top: the loader, its worker processes, the shared-memory ring and the memory budget."""
