"""Fields: a sample's schema, each field's value and per-field stages, and the batch layout the fields make."""
