"""kvserve.protos (later issues)."""
