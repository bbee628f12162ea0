"""kvserve.deploy (later issues)."""
