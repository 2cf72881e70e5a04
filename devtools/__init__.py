"""Developer tooling for meshserve (model building and other offline helpers)."""
