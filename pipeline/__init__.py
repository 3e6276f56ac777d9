"""Run machinery shared by every algorithm: driver, client-state store, outputs."""
