"""kvserve.router (later issues)."""
