"""Where bytes come from: stores (local, HTTP, object stores), remote reads, the cache, listings, finding a manifest."""
