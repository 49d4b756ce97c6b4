"""Where bytes come from: the stores (local, HTTP, object stores), remote reads, the cache, listings, finding a manifest."""
