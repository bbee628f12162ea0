"""The router actor: owns the worker actors, polls their load, picks a worker per request
through pluggable policies. Imports workers, kvcache and the core (never deploy)."""
